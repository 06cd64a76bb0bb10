"""EngineClient and ModelManager, the UI's one door to the engine, checked without a browser.

References are independent of the code under test: prompt token counts from the model's own HF tokenizer and
chat template, command lines parsed back by app.py's real argument parser, snippets compiled / JSON-parsed,
Hub behaviour from a local fake Hub (tests/fake_hub.py) speaking huggingface_hub's endpoints.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from pathlib import Path

import pytest
from fake_hub import FakeHub

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from ui.client import ChatSettings, EngineClient, ServerFacts, UIError, chat_messages, memory_segments
from ui.model_manager import ModelManager
from ui.server_tab import command_line, server_info, snippets

REPO = "pagoda-test/tiny-copy"


@pytest.fixture(scope="module")
def engine(default_model_dir):
    eng = AsyncEngine(EngineArgs(model=str(default_model_dir), kv_cache_memory="32MiB", seed=0))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hub(default_model_dir):
    files = {n: (default_model_dir / n).read_bytes() for n in ("config.json", "tokenizer.json", "tokenizer_config.json")}
    files["model.safetensors"] = os.urandom(3 << 20)
    with FakeHub() as fake:
        fake.add_repo(REPO, files)
        yield fake


@pytest.fixture()
def client(engine, hub, tmp_path):
    from engine.hub import HubDownloader

    downloader = HubDownloader(cache_dir=tmp_path / "hf", endpoint=hub.endpoint, token=None, offline=False)
    models = ModelManager(engine, downloader=downloader, state_path=tmp_path / "ui-models.json")
    c = EngineClient(engine, port=8123, models=models, sample_interval=0.2)
    yield c
    c.close()


def run(coro):
    return asyncio.run(coro)


async def collect(client, history, settings):
    return [chunk async for chunk in client.chat_stream(history, settings)]


def test_gradio6_parts_are_flattened_and_the_system_prompt_comes_first():
    history = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
               {"role": "assistant", "content": "Hi!", "stats": "3 tokens"}]
    assert chat_messages(history, "  Be brief. ") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi!"}]
    assert chat_messages(history, "")[0]["role"] == "user"


def test_chat_streams_growing_text_with_counts_that_match_the_hf_template(client, default_model_dir):
    from transformers import AutoTokenizer

    history = [{"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}]
    chunks = run(collect(client, history, ChatSettings(system_prompt="Be brief.", temperature=0.0, max_tokens=24)))
    texts = [c.text for c in chunks]
    assert len(chunks) >= 3 and chunks[-1].finished and not chunks[0].finished
    assert all(len(a) <= len(b) for a, b in itertools.pairwise(texts)) and texts[-1].strip()
    hf = AutoTokenizer.from_pretrained(str(default_model_dir))
    expected = hf.apply_chat_template([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Name three colors."}],
                                      tokenize=False, add_generation_prompt=True)
    final = chunks[-1].stats
    assert final.prompt_tokens == len(hf(expected, add_special_tokens=False)["input_ids"])
    assert final.completion_tokens == len(hf(texts[-1], add_special_tokens=False)["input_ids"]) or \
        final.finish_reason == "stop"
    assert final.finish_reason in ("stop", "length") and final.tokens_per_s > 0
    assert "tok/s" in final.describe() and f"prompt {final.prompt_tokens} tokens" in final.describe()


def test_bad_chat_input_is_a_readable_uierror(client, engine):
    with pytest.raises(UIError, match="empty"):
        run(collect(client, [{"role": "user", "content": "   "}], ChatSettings()))
    with pytest.raises(UIError, match="empty"):
        run(collect(client, [], ChatSettings()))
    words = "lorem ipsum " * engine.max_model_len
    with pytest.raises(UIError, match="context"):
        run(collect(client, [{"role": "user", "content": words}], ChatSettings()))
    with pytest.raises(UIError, match="temperature"):
        run(collect(client, [{"role": "user", "content": "hi"}], ChatSettings(temperature=-1.0)))


def test_two_chats_at_once_run_in_one_batch_and_the_dashboard_sees_them(client):
    seen_running, seen_rows = 0, 0

    async def watch(stop: asyncio.Event):
        nonlocal seen_running, seen_rows
        while not stop.is_set():
            snap = client.dashboard()
            seen_running = max(seen_running, snap.stats.get("num_running", 0))
            seen_rows = max(seen_rows, len(snap.rows))
            await asyncio.sleep(0.01)

    async def both():
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        settings = ChatSettings(temperature=1.0, max_tokens=32, seed=1)
        results = await asyncio.gather(collect(client, [{"role": "user", "content": "Tell a story."}], settings),
                                       collect(client, [{"role": "user", "content": "Tell a joke."}], settings))
        stop.set()
        await watcher
        return results

    first, second = run(both())
    assert first[-1].finished and second[-1].finished
    assert seen_running == 2 and seen_rows == 2
    snap = client.dashboard()
    assert snap.stats["num_running"] == 0 and snap.rows == []
    assert snap.stats["generation_tokens_total"] >= first[-1].stats.completion_tokens + \
        second[-1].stats.completion_tokens


def test_memory_report_segments_add_up_to_the_device_total(client):
    snap = client.dashboard()
    assert snap.device == "cpu" or snap.device == "cuda"
    parts = memory_segments(snap.memory, snap.device)
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(snap.memory["device_total"], rel=0.02)
    assert parts["weights"] > 100e6 and parts["kv_in_use"] + parts["kv_free"] == snap.memory["kv_allocated"]


def test_throughput_history_counts_generated_tokens(client):
    client.sampler.sample()
    run(collect(client, [{"role": "user", "content": "Count to ten."}], ChatSettings(temperature=0.0, max_tokens=16)))
    client.sampler.sample()
    assert any(s.generation_tps > 0 for s in client.dashboard().history)


def test_command_line_reproduces_the_settings_through_the_real_parser():
    import app

    args = EngineArgs(model="smollm2-135m-instruct-awq", max_model_len=2048, enable_prefix_caching=False,
                      kv_cache_memory="64MiB", gpu_memory_limit="20GiB", enforce_eager=True)
    line = command_line(args, "0.0.0.0", 9000, api_key_required=True)
    argv = line.replace("\\\n", " ").split()[2:]  # drop "python app.py"
    argv = [a for a in argv if a != '"$PAGODA_API_KEY"']
    argv[argv.index("--api-key"):argv.index("--api-key") + 1] = ["--api-key", "k"]
    ns = app.build_parser().parse_args(argv)
    assert app.engine_args_from(ns) == args and ns.host == "0.0.0.0" and ns.port == 9000 and ns.api_key == "k"


def test_snippets_are_valid_python_and_json():
    python, curl = snippets("http://127.0.0.1:7860/v1", "m", api_key_required=True)
    compile(python, "snippet", "exec")
    body = curl.split("-d '", 1)[1].rsplit("'", 1)[0]
    assert json.loads(body)["model"] == "m"
    assert "Authorization: Bearer $PAGODA_API_KEY" in curl and 'os.environ["PAGODA_API_KEY"]' in python


def test_tool_calling_snippet_is_valid_python_for_the_running_model(client, engine):
    import ast

    info = server_info(client.server_facts())
    tree = ast.parse(info.tools_snippet)  # a SyntaxError fails here
    compile(tree, "snippet", "exec")
    calls = {}  # called name -> keyword arguments of each call
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            calls.setdefault(name, []).append({kw.arg: kw.value for kw in node.keywords})
    assert ast.literal_eval(calls["OpenAI"][0]["base_url"]) == info.api_url
    assert len(calls["create"]) == 2  # the call, then the answer to its result
    for kwargs in calls["create"]:
        assert ast.literal_eval(kwargs["model"]) == engine.model_name and "tools" in kwargs
    assert ast.literal_eval(calls["create"][0]["tool_choice"]) == "required"
    keyed = server_info(ServerFacts(**{**vars(client.server_facts()), "api_key_required": True}))
    assert 'api_key=os.environ["PAGODA_API_KEY"]' in keyed.tools_snippet
    compile(keyed.tools_snippet, "snippet", "exec")


def test_server_info_names_the_endpoint_and_the_served_model(client, engine):
    info = server_info(client.server_facts())
    assert info.api_url == "http://127.0.0.1:8123/v1" and info.model == engine.model_name
    assert "--port 8123" in info.command_line and f'model="{engine.model_name}"' in info.python_snippet
    assert server_info(client.server_facts(), "http://example.test:99").api_url == "http://example.test:99/v1"


def test_hub_repo_add_then_download_with_progress(client, hub):
    models = client.models
    with pytest.raises(UIError, match="not a Hub repo id"):
        models.add("not a repo!")
    with pytest.raises(UIError, match="was not found"):
        models.add("nobody/nothing-here")
    with pytest.raises(UIError, match="already in the catalog"):
        models.add("Qwen/Qwen2.5-0.5B-Instruct-AWQ")
    row = models.add(REPO)
    expected_size = sum(len(data) for name, data in hub.repos[REPO].files.items() if name.endswith(".safetensors"))
    assert row.id == f"hub:{REPO}" and not row.downloaded and row.fits is not None
    assert row.size_bytes >= expected_size
    with pytest.raises(UIError, match="not downloaded yet"):
        models.load_reference(row.id)
    status = models.start_download(row.id)
    fractions = []
    deadline = time.monotonic() + 60
    while not status.finished and time.monotonic() < deadline:
        fractions.append(status.fraction)
        time.sleep(0.01)
        status = models.job(row.id)
    assert status.state == "done" and status.bytes_done == status.bytes_total >= expected_size
    assert models.row(row.id).downloaded
    assert Path(models.load_reference(row.id), "config.json").is_file()
    with pytest.raises(UIError, match="no download"):
        models.cancel(row.id)
    again = ModelManager(client.engine, downloader=models.downloader, state_path=models.state_path)
    assert again.row(row.id).downloaded, "added models are remembered across restarts"


def test_local_folders_are_added_or_refused_by_policy(client, default_model_dir, engine, tmp_path):
    row = client.models.add(str(default_model_dir))
    assert row.downloaded and row.loaded and row.fits  # the engine serves this very folder
    closed = ModelManager(engine, downloader=client.models.downloader, state_path=tmp_path / "other.json",
                          allow_local_paths=False)
    with pytest.raises(UIError, match="disabled"):
        closed.add(str(default_model_dir))
    with pytest.raises(UIError, match="no such"):
        client.models.add("/definitely/not/here")
    with pytest.raises(UIError, match="Enter a Hugging Face repo id"):
        client.models.add("  ")


def test_an_open_server_loads_only_catalog_models_like_the_api(client, default_model_dir, engine):
    """On a network address without a key the UI follows the API's rules: no local folders (added or loaded),
    no downloads, builds or Hub adds; catalog models already on this machine still load."""
    from engine.serving.server import ServerSettings

    open_server = ServerSettings(api_key=None, host="0.0.0.0")
    assert not open_server.allow_local_paths and not open_server.allow_downloads
    for private in (ServerSettings(), ServerSettings(api_key="k", host="0.0.0.0")):
        assert private.allow_local_paths and private.allow_downloads
    added = client.models.add(str(default_model_dir))  # remembered from a private session
    closed = ModelManager(engine, downloader=client.models.downloader, state_path=client.models.state_path,
                          allow_local_paths=open_server.allow_local_paths,
                          allow_downloads=open_server.allow_downloads)
    hub_id = next(r.id for r in closed.rows() if r.source == "hub")
    for refused in (lambda: closed.add(str(default_model_dir)), lambda: closed.add(REPO),
                    lambda: closed.load_reference(added.id), lambda: closed.start_download(hub_id),
                    lambda: closed.start_download("smollm2-135m-instruct-gptq")):
        with pytest.raises(UIError, match="disabled on a server that listens on a network address"):
            refused()
    assert closed.load_reference("smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_load_refusals_are_readable(client):
    with pytest.raises(UIError, match="unknown model"):
        run(client.load_model("no-such-model"))
    missing = next(r for r in client.models.rows() if not r.downloaded and r.id.startswith("qwen"))
    with pytest.raises(UIError, match="not downloaded yet"):
        run(client.load_model(missing.id))
