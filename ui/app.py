"""Assembles the Gradio Blocks (header + Chat, Models, Dashboard, Server tabs) around one EngineClient."""

from __future__ import annotations

import gradio as gr

from ui.chat_tab import build_chat_tab
from ui.client import EngineClient
from ui.dashboard_tab import build_dashboard_tab
from ui.models_tab import build_models_tab
from ui.server_tab import ServerTab, build_server_tab

TITLE = "Pagoda"
LOGO = """<div class="brand"><svg viewBox="0 0 32 32" width="34" height="34" aria-hidden="true">
<rect width="32" height="32" rx="8" fill="#4f46e5"/>
<path d="M16 5 L25 11 H7 Z M9 14 H23 L26 18 H6 Z M10 21 H22 L25 25 H7 Z" fill="#fff"/>
<rect x="15" y="11" width="2" height="3" fill="#fff"/><rect x="15" y="18" width="2" height="3" fill="#fff"/></svg>
<div><div class="brand-name">Pagoda</div>
<div class="brand-sub">Local LLM workstation · paged-KV continuous-batching engine</div></div></div>"""

CSS = """
.gradio-container { max-width: 1320px !important; margin: 0 auto !important; }
#pagoda-header { align-items: center; padding: 4px 0 2px; }
.brand { display: flex; align-items: center; gap: 12px; }
.brand-name { font-size: 1.45rem; font-weight: 700; letter-spacing: -0.01em; line-height: 1.2; }
.brand-sub { color: var(--body-text-color-subdued); font-size: 0.88rem; }
#model-status { text-align: right; }
#models-table *, #dash-requests * { font-family: var(--font) !important; }
#server-settings table { font-size: 0.85rem; border-collapse: collapse; }
#server-settings td, #server-settings th { padding: 3px 10px !important;
                                           border: 1px solid var(--border-color-primary) !important; }
#model-status p { display: inline-block; padding: 6px 12px; border-radius: 999px;
                  background: var(--background-fill-secondary); border: 1px solid var(--border-color-primary); }
.model-line p { margin: 0 0 4px; color: var(--body-text-color-subdued); }
.side-panel { border-left: 1px solid var(--border-color-primary); padding-left: 12px !important; }
.side-panel h3 { margin-top: 0; }
.reply-stats { display: block; margin-top: 6px; font-size: 0.78em; color: var(--body-text-color-subdued); }
.stats-line p { font-size: 0.85rem; color: var(--body-text-color-subdued); margin: 0; }
.note { border-radius: 8px; padding: 8px 12px; font-size: 0.95rem; }
.note-ok { border: 1px solid #badbcc; background: #f3faf6; color: #0f5132; }
.note-error { border: 1px solid #f5c2c7; background: #fff5f5; color: #842029; }
.add-btn { align-self: end; margin-bottom: 6px; }
.muted, .muted p { color: var(--body-text-color-subdued); font-size: 0.85rem; }
.mem-card { border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 12px 16px;
            background: var(--background-fill-primary); }
.mem-title { font-weight: 600; margin-bottom: 6px; }
.mem-sub { margin: 10px 0 4px; font-size: 0.85rem; color: var(--body-text-color-subdued); }
.mem-bar { display: flex; height: 26px; border-radius: 6px; overflow: hidden; background: #eef0f3;
           border: 1px solid var(--border-color-primary); }
.mem-bar .seg { height: 100%; min-width: 2px; transition: width 0.4s ease; }
.seg-weights { background: #6366f1; } .seg-kv_in_use { background: #f59e0b; } .seg-kv_free { background: #fcd9a0; }
.seg-activations { background: #10b981; } .seg-ours_other { background: #a78bfa; }
.seg-other_processes { background: #94a3b8; } .seg-free { background: #e5e7eb; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 18px; margin-top: 10px; font-size: 0.85rem; }
.legend-item { display: inline-flex; align-items: center; gap: 6px; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 3px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(180px, 1fr)); gap: 10px; }
.stat-card { border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 10px 14px;
             background: var(--background-fill-primary); }
.card-label { font-size: 0.8rem; color: var(--body-text-color-subdued); text-transform: uppercase;
              letter-spacing: 0.04em; }
.card-value { font-size: 1.5rem; font-weight: 650; margin: 2px 0; font-variant-numeric: tabular-nums; }
.card-sub { font-size: 0.78rem; color: var(--body-text-color-subdued); }
.job { border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 10px 14px; }
.job-title { font-weight: 600; margin-bottom: 6px; }
.job-text { font-size: 0.85rem; margin-top: 4px; font-variant-numeric: tabular-nums; }
.progress { height: 10px; border-radius: 5px; background: #eef0f3; overflow: hidden; }
.progress-fill { height: 100%; background: #6366f1; transition: width 0.4s ease; }
.progress-busy .progress-fill { animation: pagoda-busy 1.2s ease-in-out infinite alternate; }
@keyframes pagoda-busy { from { margin-left: 0; } to { margin-left: 65%; } }
.endpoint { font-family: var(--font-mono); font-size: 1.15rem; padding: 8px 12px; border-radius: 8px;
            background: var(--background-fill-secondary); display: inline-block; }
footer { display: none !important; }
"""


def theme() -> gr.themes.Base:
    """Soft indigo, with system fonts only: a local workstation must not fetch fonts from the internet."""
    return gr.themes.Soft(primary_hue="indigo", secondary_hue="slate", neutral_hue="slate",
                          font=["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"]).set(
        block_label_background_fill="transparent", block_title_background_fill="transparent",
        block_label_text_color="*neutral_700", block_title_text_color="*neutral_700",
        block_title_text_weight="600", block_label_text_weight="600", block_title_padding="0",
        block_label_padding="0")


def build_blocks(client: EngineClient) -> gr.Blocks:
    """The whole UI. Theme and CSS are applied where it is mounted (Gradio 6 takes them at mount/launch)."""
    with gr.Blocks(title=TITLE, fill_width=True, analytics_enabled=False) as demo:  # no telemetry: a local app
        with gr.Row(elem_id="pagoda-header", equal_height=True):
            gr.HTML(LOGO, elem_id="pagoda-title", scale=3)
            status = gr.Markdown(client.model_summary, elem_id="model-status", scale=2)  # fresh per page load
        with gr.Tabs(elem_id="tabs"):
            with gr.Tab("Chat", id="chat", elem_id="tab-chat") as chat_page:
                build_chat_tab(client, status)
            with gr.Tab("Models", id="models", elem_id="tab-models") as models_page:
                models = build_models_tab(client, [status])
            with gr.Tab("Dashboard", id="dashboard", elem_id="tab-dashboard") as dashboard_page:
                dashboard = build_dashboard_tab(client)
            with gr.Tab("Server", id="server", elem_id="tab-server") as server_page:
                server = build_server_tab(client)
        wire_pages(client, status, models, dashboard, server,
                   (chat_page, models_page, dashboard_page, server_page))
    return demo


def wire_pages(client, status, models, dashboard, server, pages) -> None:
    """Tab switches refresh what the tab shows; only the Dashboard tab keeps its timer running."""
    chat_page, models_page, dashboard_page, server_page = pages
    timer = dashboard.timer
    quick = {"queue": False, "show_progress": "hidden"}

    def summaries():
        return client.model_summary(), gr.Timer(active=False)

    def models_view():
        current = client.models.rows()
        from ui.models_tab import choices, table_frame

        return table_frame(client, current), gr.update(choices=choices(current)), \
            f"**Memory budget:** {client.models.budget().label}", gr.Timer(active=False)

    def dashboard_view():
        return (*dashboard.refresh(), gr.Timer(active=True))

    def server_view(request: gr.Request):
        return (*ServerTab.values(client, request), gr.Timer(active=False))

    chat_page.select(summaries, None, [status, timer], **quick)
    models_page.select(models_view, None, [models.table, models.choice, models.budget, timer], **quick)
    dashboard_page.select(dashboard_view, None, [*dashboard.outputs, timer], show_progress="hidden")
    server_page.select(server_view, None, [*server.outputs, timer], **quick)
