"""The Models tab: the catalog and added models in a table, download/build with progress, load/switch, unload, add.

Long actions (downloads, loads) are async generators that poll and yield a progress bar twice a second, so the
page shows movement and the result (or a readable reason) when they end. A load runs as a task that survives
the page being closed; the engine keeps serving the previous model if the new one fails.
"""

from __future__ import annotations

import asyncio
import html
import re
import time
from dataclasses import dataclass

import gradio as gr
import pandas as pd

from engine.fit import format_bytes
from ui.client import EngineClient, UIError
from ui.model_manager import JobStatus, ModelRow, format_size

TABLE_HEADERS = ["Model", "ID", "Format", "Size", "Context", "Fits budget", "On disk", "Status"]
POLL_S = 0.5
UNCHANGED = (gr.update(), gr.update(), gr.update(), gr.update())  # table, choice, budget, details


@dataclass
class ModelsTab:
    table: gr.Dataframe
    choice: gr.Dropdown
    budget: gr.Markdown


def _status(row: ModelRow, job: JobStatus | None) -> str:
    if row.loaded:
        return "● serving"
    if job is not None and not job.finished:
        if job.fraction is not None:
            return f"{job.kind} {100 * job.fraction:.0f}%"
        return f"{job.kind}ing …".replace("eing", "ing")
    if job is not None and job.state in ("failed", "cancelled"):
        return f"{job.kind} {job.state}"
    return ""


def table_frame(client: EngineClient, rows: list[ModelRow]) -> pd.DataFrame:
    data = [(r.name, r.id, r.quantization, format_size(r.size_bytes), f"{r.context:,}" if r.context else "—",
             r.fit_label, "✓ yes" if r.downloaded else "—", _status(r, client.models.job(r.id))) for r in rows]
    return pd.DataFrame(data, columns=TABLE_HEADERS)


def choices(rows: list[ModelRow]) -> list[tuple[str, str]]:
    return [(f"{r.name}  ({r.id})" if r.name != r.id else r.id, r.id) for r in rows]


def details_md(row: ModelRow | None) -> str:
    if row is None:
        return ""
    state = "serving now" if row.loaded else ("on disk" if row.downloaded else "not on this machine yet")
    notes = f"<br>{html.escape(row.notes)}" if row.notes else ""
    return (f"**{html.escape(row.name)}** · {row.source} · {row.quantization} · {state}{notes}<br>"
            f"<span class='muted'>Fit: {html.escape(row.fit_message)}</span>")


def progress_html(status: JobStatus | None) -> str:
    if status is None:
        return ""
    if status.fraction is not None:
        pct = 100 * status.fraction
        rate = f" · {format_bytes(status.rate)}/s" if status.rate else ""
        eta = f" · {status.eta_s:.0f} s left" if status.eta_s and not status.finished else ""
        text = f"{format_bytes(status.bytes_done)} / {format_bytes(status.bytes_total)} ({pct:.0f}%){rate}{eta}"
        bar = f"<div class='progress'><div class='progress-fill' style='width:{pct:.1f}%'></div></div>"
    else:
        text = html.escape(status.message or status.state)
        busy = "" if status.finished else " progress-busy"
        bar = f"<div class='progress{busy}'><div class='progress-fill' style='width:{100 if status.finished else 35}%'></div></div>"
    title = {"download": "Download", "build": "Build", "convert": "GGUF conversion"}.get(status.kind, status.kind)
    state = {"running": "in progress", "queued": "queued"}.get(status.state, status.state)
    detail = "" if status.fraction is None or status.finished else f"<div class='muted'>{html.escape(status.message)}</div>"
    return (f"<div class='job' id='download-progress-{status.state}'><div class='job-title'>{title} of "
            f"{html.escape(status.row_id)}: {state}</div>{bar}<div class='job-text'>{text}</div>{detail}</div>")


def loading_html(row_id: str, elapsed: float) -> str:
    return (f"<div class='job'><div class='job-title'>Loading {html.escape(row_id)} … {elapsed:.0f} s</div>"
            "<div class='progress progress-busy'><div class='progress-fill' style='width:35%'></div></div>"
            "<div class='muted'>Reading weights, profiling memory and sizing the KV cache. The current model "
            "keeps serving until the new one is ready.</div></div>")


def _note(kind: str, mark: str, text: str) -> str:
    """A result line as HTML: the text escaped, then **bold** spans restored."""
    body = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text))
    return f"<div class='note note-{kind}' role='status'>{mark} {body}</div>"


def ok_md(text: str) -> str:
    return _note("ok", "✓", text)


def err_md(text: str) -> str:
    return _note("error", "⚠", text)


def build_models_tab(client: EngineClient, status_lines: list[gr.Markdown]) -> ModelsTab:
    """``status_lines`` (the header and the chat tab's model line) are updated after a load or unload."""
    rows = client.models.rows()
    budget = gr.Markdown(f"**Memory budget:** {client.models.budget().label}", elem_id="models-budget")
    table = gr.Dataframe(table_frame(client, rows), headers=TABLE_HEADERS, interactive=False, wrap=True,
                         elem_id="models-table", max_height=420,
                         column_widths=["24%", "20%", "9%", "8%", "8%", "13%", "8%", "10%"])
    with gr.Row(equal_height=True):
        choice = gr.Dropdown(choices(rows), value=None, label="Selected model", scale=3, elem_id="model-choice",
                             info="pick here or click a row in the table")
        max_len = gr.Textbox(label="Context length (max_model_len)", placeholder="model default",
                             info="tokens; empty = the model's own (capped to what fits)", scale=1,
                             elem_id="model-max-len")
    details = gr.Markdown(elem_id="model-details")
    with gr.Row():
        download = gr.Button("⬇ Download / build", elem_id="model-download")
        cancel = gr.Button("Cancel download", elem_id="model-cancel")
        load = gr.Button("▶ Load", variant="primary", elem_id="model-load")
        unload = gr.Button("⏏ Unload", variant="stop", elem_id="model-unload")
    progress = gr.HTML(elem_id="model-progress")
    result = gr.HTML(elem_id="model-result")
    with gr.Accordion("Add a model from the Hub or a local folder / GGUF file", open=False, elem_id="add-model"):
        with gr.Row(equal_height=False):
            reference = gr.Textbox(label="Hub repo id or local path", scale=3, elem_id="add-ref",
                                   placeholder="Qwen/Qwen2.5-0.5B-Instruct-AWQ   or   /models/my-model   or   "
                                               "/models/model.Q4_K_M.gguf")
            token = gr.Textbox(label="Hugging Face token", type="password", scale=2, elem_id="hf-token",
                               placeholder="hf_… (gated or private repos; kept for this page only)")
            add = gr.Button("Add model", scale=0, min_width=130, elem_id="add-model-btn", elem_classes=["add-btn"])
        gr.Markdown("Hub repos are checked before any download (files, architecture, quantization, size). "
                    "GGUF files are converted to fp16 safetensors once. The token is only sent to the Hub.",
                    elem_classes=["muted"])
    listing = [table, choice, budget, details]

    def refreshed(selected: str | None = None) -> tuple:
        """The table, the list (keeping the selection), the budget line and the selection's details."""
        current = client.models.rows()
        chosen = next((r for r in current if r.id == selected), None)
        return (table_frame(client, current),
                gr.update(choices=choices(current), value=chosen.id if chosen else None),
                f"**Memory budget:** {client.models.budget().label}", details_md(chosen))

    def summaries() -> list[str]:
        return [client.model_summary()] * len(status_lines)

    def pick_row(evt: gr.SelectData):
        current = client.models.rows()
        index = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        if not isinstance(index, int) or not 0 <= index < len(current):
            return gr.update(), ""
        return current[index].id, details_md(current[index])

    def describe(row_id: str | None) -> str:
        try:
            return details_md(client.models.row(row_id)) if row_id else ""
        except UIError:
            return ""

    async def start_download(row_id: str | None, hf_token: str):
        if not row_id:
            gr.Warning("Select a model first.")
            yield "", err_md("Select a model in the table or the list first."), *refreshed(row_id)
            return
        try:
            status = client.models.start_download(row_id, hf_token or None)
        except UIError as exc:
            gr.Warning(exc.message)
            yield "", err_md(exc.message), *refreshed(row_id)
            return
        while not status.finished:
            yield progress_html(status), "", *refreshed(row_id)  # the table shows the percentage too
            await asyncio.sleep(POLL_S)
            status = client.models.job(row_id) or status
        if status.state == "done":
            yield progress_html(status), ok_md(f"{row_id} is on this machine: click Load to serve it."), \
                *refreshed(row_id)
        else:
            message = status.message if status.state == "failed" else "Cancelled; starting again resumes it."
            if status.state == "failed":
                gr.Warning(message)
            yield progress_html(status), err_md(message), *refreshed(row_id)

    def cancel_download(row_id: str | None):
        try:
            client.models.cancel(row_id or "")
        except UIError as exc:
            gr.Warning(exc.message)
            return err_md(exc.message)
        return ok_md(f"Cancelling the download of {row_id} …")

    async def load_model(row_id: str | None, context_text: str | None):
        if not row_id:
            gr.Warning("Select a model first.")
            yield "", err_md("Select a model in the table or the list first."), *refreshed(row_id), *summaries()
            return
        context_text = (context_text or "").strip().replace(",", "").replace("_", "")
        if context_text and (not context_text.isdigit() or int(context_text) < 1):
            message = f"The context length must be a whole number of tokens (or empty), not '{context_text[:40]}'."
            gr.Warning(message)
            yield "", err_md(message), *refreshed(row_id), *summaries()
            return
        context = int(context_text) if context_text else None
        stats = client.dashboard().stats
        in_flight = int(stats.get("num_running", 0) or 0) + int(stats.get("num_waiting", 0) or 0)
        started = time.monotonic()
        task = asyncio.ensure_future(client.load_model(row_id, context))
        while not task.done():
            yield loading_html(row_id, time.monotonic() - started), "", *UNCHANGED, *summaries()
            await asyncio.wait([task], timeout=POLL_S)
        try:
            info = task.result()
        except UIError as exc:
            gr.Warning(exc.message)
            serving = client.model_name
            still = f" {serving} is still serving." if serving else ""
            yield "", err_md(exc.message + still), *refreshed(row_id), *summaries()
            return
        ended = f" {in_flight} request(s) in flight on {info.previous} were ended." if in_flight and info.previous \
            else ""
        text = (f"Now serving **{info.model}** (loaded in {info.load_seconds:.1f} s, context "
                f"{info.max_model_len:,} tokens).{ended}")
        yield "", ok_md(text), *refreshed(row_id), *summaries()

    async def unload_model(row_id: str | None):
        name = await client.unload_model()
        message = ok_md(f"Unloaded {name}; its memory was released.") if name else err_md("No model is loaded.")
        return "", message, *refreshed(row_id), *summaries()

    async def add_model(ref: str, hf_token: str, row_id: str | None):
        try:
            row = await asyncio.to_thread(client.models.add, ref, hf_token or None)
        except UIError as exc:
            gr.Warning(exc.message)
            return err_md(exc.message), gr.update(), *refreshed(row_id)
        job = client.models.job(row.id)
        more = " Converting it to safetensors now; follow the progress in the table." if job else ""
        return ok_md(f"Added {row.name} ({row.quantization}, {format_size(row.size_bytes)}).{more}"), "", \
            *refreshed(row.id)

    table.select(pick_row, None, [choice, details], queue=False)
    choice.change(describe, [choice], [details], queue=False)
    model_ops = {"concurrency_limit": 1, "concurrency_id": "model-ops"}
    quiet = {"show_progress": "hidden"}  # these draw their own progress bar
    download.click(start_download, [choice, token], [progress, result, *listing], concurrency_limit=None, **quiet)
    cancel.click(cancel_download, [choice], [result], **quiet)
    load.click(load_model, [choice, max_len], [progress, result, *listing, *status_lines], **model_ops, **quiet)
    unload.click(unload_model, [choice], [progress, result, *listing, *status_lines], **model_ops, **quiet)
    add.click(add_model, [reference, token, choice], [result, reference, *listing], concurrency_limit=4,
              show_progress="minimal")
    return ModelsTab(table, choice, budget)
