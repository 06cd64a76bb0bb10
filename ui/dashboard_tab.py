"""The Dashboard tab: live device memory bar, KV/prefix-cache/queue numbers, tokens/s plot, per-request table.

Refreshed by a ``gr.Timer`` once a second that the app activates only while this tab is selected, so a page
left on another tab (or closed) costs the server nothing. Each tick reads one ``DashboardSnapshot``, made from
the engine snapshot its loop published after its last step (counts, request rows, memory report: no device work,
no engine internals).
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr
import pandas as pd

from engine.fit import format_bytes as _format_bytes
from ui.client import DashboardSnapshot, EngineClient, memory_segments

PLOT_SECONDS = 300
REQUEST_HEADERS = ["Request", "State", "Prompt tokens", "Output tokens", "Cached tokens", "KV blocks", "Preemptions"]
# (key, legend, css class); the memory bar draws them left to right
SEGMENTS = (("weights", "Weights"), ("kv_in_use", "KV cache in use"), ("kv_free", "KV cache free"),
            ("activations", "Activations + graphs"), ("ours_other", "Pagoda runtime (context, caches)"),
            ("other_processes", "Other processes"), ("free", "Free"))


def format_bytes(num: float) -> str:
    return "0 B" if not num else _format_bytes(num)


@dataclass
class DashboardTab:
    timer: gr.Timer
    outputs: list
    refresh: Callable[[], tuple]


def _bar(parts: dict[str, int], keys: tuple[str, ...], total: int, elem_id: str) -> str:
    cells = []
    for key in keys:
        share = 100.0 * parts[key] / total if total else 0.0
        if share <= 0:
            continue
        label = dict(SEGMENTS)[key]
        cells.append(f"<div class='seg seg-{key}' style='width:{share:.3f}%' "
                     f"title='{label}: {format_bytes(parts[key])} ({share:.1f}%)'></div>")
    return f"<div class='mem-bar' id='{elem_id}'>{''.join(cells)}</div>"


def memory_html(snapshot: DashboardSnapshot) -> str:
    memory = snapshot.memory
    if memory is None:
        text = (f"Loading {snapshot.loading} …" if snapshot.loading else
                "The memory report is not available right now." if snapshot.model else
                "No model loaded: nothing to show.")
        return f"<div class='mem-card'><div class='mem-title'>Memory</div><p class='muted'>{text}</p></div>"
    parts = memory_segments(memory, snapshot.device)
    keys = tuple(k for k, _ in SEGMENTS)
    total = memory["device_total"]
    ours_keys = ("weights", "kv_in_use", "kv_free", "activations")
    ours_total = sum(parts[k] for k in ours_keys)
    if snapshot.device == "cuda":
        title = f"GPU memory · {html.escape(memory['device_name'])} · {format_bytes(total)}"
        note = ""
    else:
        title = f"System memory (CPU mode) · {format_bytes(total)}"
        note = (f"<p class='muted'>No GPU: Pagoda runs on the CPU, so this shows system RAM; this process uses "
                f"{format_bytes(memory['process_rss'])} (resident).</p>")
    legend = "".join(f"<span class='legend-item'><i class='swatch seg-{k}'></i>{label} "
                     f"<b id='mem-{k.replace('_', '-')}'>{format_bytes(parts[k])}</b></span>" for k, label in SEGMENTS)
    return (f"<div class='mem-card'><div class='mem-title'>{title}</div>{note}"
            f"{_bar(parts, keys, total, 'mem-bar-device')}"
            f"<div class='mem-sub'>This model: {format_bytes(ours_total)} (weights + KV cache + activations)</div>"
            f"{_bar(parts, ours_keys, ours_total, 'mem-bar-model')}"
            f"<div class='legend'>{legend}</div></div>")


def _card(elem_id: str, label: str, value: str, sub: str = "") -> str:
    sub_html = f"<div class='card-sub'>{sub}</div>" if sub else ""
    return (f"<div class='stat-card'><div class='card-label'>{label}</div>"
            f"<div class='card-value' id='{elem_id}'>{value}</div>{sub_html}</div>")


def cards_html(snapshot: DashboardSnapshot) -> str:
    s = snapshot.stats
    if "num_total_blocks" not in s:
        return "<div class='cards'></div>"
    total, free = s["num_total_blocks"], s["num_free_blocks"]
    used = s.get("num_used_blocks", total - free)
    queries, hits = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
    rate = f"{100.0 * hits / queries:.1f}%" if queries else "—"
    recent = snapshot.history[-1] if snapshot.history else None
    gen_now = f"{recent.generation_tps:.1f}" if recent else "0.0"
    prompt_now = f"{recent.prompt_tps:.1f}" if recent else "0.0"
    block = s.get("block_size", 16)
    return "<div class='cards'>" + "".join([
        _card("stat-kv-used", "KV blocks in use", f"{used:,} / {total:,}",
              f"{100.0 * used / max(total, 1):.1f}% · {block} tokens per block · {s.get('num_cached_blocks', 0):,} "
              "cached for reuse"),
        _card("stat-prefix-hit", "Prefix-cache hit rate", rate, f"{hits:,} of {queries:,} prompt tokens"),
        _card("stat-running", "Running", f"{s.get('num_running', 0)}", "requests in the batch"),
        _card("stat-waiting", "Waiting", f"{s.get('num_waiting', 0)}",
              f"{s.get('num_preemptions', 0)} preemptions so far"),
        _card("stat-gen-tps", "Generation", f"{gen_now} tok/s", f"prompt {prompt_now} tok/s"),
        _card("stat-gen-total", "Tokens generated", f"{s.get('generation_tokens_total', 0):,}",
              f"{s.get('prompt_tokens_total', 0):,} prompt tokens processed"),
    ]) + "</div>"


def throughput_frame(snapshot: DashboardSnapshot) -> pd.DataFrame:
    """Rows (seconds ago, series, tokens/s) for the last PLOT_SECONDS; two zero points when there is no history
    yet (an empty frame makes the plot library draw garbage axes)."""
    now = time.time()
    rows = []
    for sample in snapshot.history:
        ago = sample.time - now
        if ago >= -PLOT_SECONDS:
            rows.append((round(ago, 1), "generation", round(sample.generation_tps, 2)))
            rows.append((round(ago, 1), "prompt", round(sample.prompt_tps, 2)))
    if not rows:
        rows = [(0.0, "generation", 0.0), (0.0, "prompt", 0.0)]
    return pd.DataFrame(rows, columns=["seconds", "series", "tokens_per_s"])


def plot_window(frame: pd.DataFrame) -> int:
    """Seconds shown: the history's span rounded up to a minute, at most PLOT_SECONDS."""
    span = -float(frame["seconds"].min()) if len(frame) else 0.0
    return int(min(PLOT_SECONDS, max(60, 60 * -(-span // 60))))


def throughput_plot(snapshot: DashboardSnapshot):
    frame = throughput_frame(snapshot)
    return gr.LinePlot(frame, x_lim=[-plot_window(frame), 0])


def request_frame(snapshot: DashboardSnapshot) -> pd.DataFrame:
    rows = [(r.request_id[:12], r.state, r.prompt_tokens, r.output_tokens, r.cached_tokens, r.blocks,
             r.preemptions) for r in snapshot.rows]
    return pd.DataFrame(rows, columns=REQUEST_HEADERS)


def header_md(snapshot: DashboardSnapshot) -> str:
    if snapshot.model is None:
        return f"**Loading {snapshot.loading} …**" if snapshot.loading else "**No model loaded.**"
    where = "GPU" if snapshot.device == "cuda" else "CPU (no GPU found: numbers describe system memory)"
    return f"**{snapshot.model}** on {where} · updated {time.strftime('%H:%M:%S', time.localtime(snapshot.taken_at))}"


def build_dashboard_tab(client: EngineClient) -> DashboardTab:
    timer = gr.Timer(1.0, active=False)
    header = gr.Markdown(elem_id="dash-header")
    memory = gr.HTML(elem_id="dash-memory")
    cards = gr.HTML(elem_id="dash-cards")
    with gr.Row():
        frame = throughput_frame(client.dashboard())
        plot = gr.LinePlot(frame, x="seconds", y="tokens_per_s", color="series",
                           x_lim=[-plot_window(frame), 0], x_title="seconds ago", y_title="tokens / s",
                           title="Throughput: prompt and generated tokens per second", height=260,
                           elem_id="dash-plot",
                           color_map={"generation": "#6366f1", "prompt": "#f59e0b"}, color_title="")
    table = gr.Dataframe(request_frame(client.dashboard()), headers=REQUEST_HEADERS, label="Requests in the engine (running first, then waiting)",
                         interactive=False, elem_id="dash-requests", max_height=320)

    refresh = refresh_fn(client)
    outputs = [header, memory, cards, plot, table]
    timer.tick(refresh, None, outputs, show_progress="hidden", concurrency_limit=None, trigger_mode="always_last")
    return DashboardTab(timer, outputs, refresh)


def refresh_fn(client: EngineClient):
    """The tick function, also run when the tab opens (so it never shows stale numbers first)."""
    def refresh():
        snapshot = client.dashboard()
        return (header_md(snapshot), memory_html(snapshot), cards_html(snapshot), throughput_plot(snapshot),
                request_frame(snapshot))
    return refresh
