"""Hub downloads against a local fake Hub: validation before transfer, progress, resume, cancel, offline, local."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub  # tests/ is on sys.path (pytest rootdir-less test folder)
from huggingface_hub import hf_hub_download, try_to_load_from_cache
from safetensors.torch import save

from engine.errors import EngineError
from engine.hub import DownloadCancelled, DownloadState, HubDownloader

MiB = 1 << 20  # huggingface_hub's http_get writes 10 MiB chunks: the resume and cancel files are bigger

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 512, "tie_word_embeddings": True, "torch_dtype": "float16",
    "bos_token_id": 1, "eos_token_id": 2,
}


def safetensors_blob(num_bytes: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)
    return save({f"blob{seed}": data})


def model_files(config: dict | None = None, shard_sizes: tuple[int, ...] = (300_000,)) -> dict[str, bytes]:
    """A repo as the Hub would hold it, with the files the engine needs and some it must not fetch."""
    files = {
        "config.json": json.dumps(config or TINY_LLAMA).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}).encode(),
        "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
        "generation_config.json": b'{"eos_token_id": 2}',
        "README.md": b"# tiny\n" * 100,
        "original/consolidated.safetensors": safetensors_blob(200_000, 99),
        "pytorch_model.bin": os.urandom(150_000),
    }
    if len(shard_sizes) == 1:
        files["model.safetensors"] = safetensors_blob(shard_sizes[0], 0)
    else:
        names = [f"model-{i + 1:05d}-of-{len(shard_sizes):05d}.safetensors" for i in range(len(shard_sizes))]
        for i, (name, size) in enumerate(zip(names, shard_sizes)):
            files[name] = safetensors_blob(size, i)
        weight_map = {f"blob{i}": name for i, name in enumerate(names)}
        files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
        files["consolidated.safetensors"] = safetensors_blob(100_000, 77)  # a duplicate to skip
    return files


NEEDED = {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}


def needed_names(files: dict[str, bytes]) -> set[str]:
    """What a loader needs, decided here independently of engine.hub: configs, tokenizer, indexed shards."""
    if "model.safetensors.index.json" in files:
        shards = set(json.loads(files["model.safetensors.index.json"])["weight_map"].values())
        return NEEDED | shards | {"model.safetensors.index.json"}
    return NEEDED | {"model.safetensors"}


@pytest.fixture()
def fake_hub():
    with FakeHub() as hub:
        yield hub


@pytest.fixture()
def hf_env(fake_hub, tmp_path, monkeypatch) -> Path:
    """HF_* variables pointing at the fake Hub and a fresh cache; returns the cache folder."""
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.endpoint)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    return cache


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_download_fetches_only_needed_files_into_the_standard_cache(fake_hub, hf_env):
    files = model_files(shard_sizes=(300_000, 200_000))
    repo = fake_hub.add_repo("org/tiny", files)

    path = HubDownloader().download("org/tiny")

    assert path == hf_env / "models--org--tiny" / "snapshots" / repo.commit
    assert {p.name for p in path.iterdir()} == needed_names(files)
    for name in needed_names(files):
        assert (path / name).read_bytes() == files[name]
    for skipped in ("pytorch_model.bin", "consolidated.safetensors", "original/consolidated.safetensors",
                    "README.md"):
        assert fake_hub.file_stats("org/tiny", skipped).gets == 0, skipped
    # huggingface_hub itself finds the files where it would have put them
    shard = "model-00001-of-00002.safetensors"
    assert try_to_load_from_cache("org/tiny", shard, cache_dir=str(hf_env)) == str(path / shard)
    again = hf_hub_download("org/tiny", shard, cache_dir=str(hf_env), local_files_only=True)
    assert Path(again).read_bytes() == files[shard]


def test_progress_events_increase_and_end_at_the_total(fake_hub, hf_env):
    files = model_files(shard_sizes=(300_000, 12 * MiB, 200_000))
    fake_hub.add_repo("org/tiny", files)
    events = []

    HubDownloader().download("org/tiny", callback=events.append)

    total = sum(len(files[n]) for n in needed_names(files))
    assert events[0].state == DownloadState.QUEUED
    assert events[-1].state == DownloadState.DONE and events[-1].error is None
    assert events[-1].bytes_done == events[-1].bytes_total == total
    assert events[-1].files_done == events[-1].files_total == len(needed_names(files))
    moving = [e for e in events if e.state == DownloadState.DOWNLOADING]
    assert len(moving) >= 4 and all(e.bytes_total == total for e in moving)
    done = [e.bytes_done for e in events]
    assert done == sorted(done)
    assert any(e.rate_bytes_per_s > 0 and e.eta_s is not None for e in moving)
    assert {e.current_file for e in moving} >= {n for n in needed_names(files) if n.endswith(".safetensors")}


def test_interrupted_download_resumes_without_refetching_finished_files(fake_hub, hf_env):
    files = model_files(shard_sizes=(300_000, 12 * MiB))
    repo = fake_hub.add_repo("org/tiny", files)
    big = "model-00002-of-00002.safetensors"
    # the connection drops after 11 MiB, and the retry that huggingface_hub makes gets a 503: the call fails
    fake_hub.cut_once("org/tiny", big, after_bytes=11 * MiB, then_status=503, then_times=1)
    downloader = HubDownloader()

    with pytest.raises(EngineError, match="503"):
        downloader.download("org/tiny")

    blob = hf_env / "models--org--tiny" / "blobs" / hashlib.sha256(files[big]).hexdigest()
    partial = blob.with_name(blob.name + ".incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < len(files[big])  # what arrived before the cut stays on disk
    before = {n: fake_hub.file_stats("org/tiny", n) for n in needed_names(files)}
    fake_hub.reset_stats()

    path = downloader.download("org/tiny")

    assert sha256(path / big) == hashlib.sha256(files[big]).hexdigest()
    assert not partial.exists()
    for name in needed_names(files) - {big}:
        assert before[name].gets == 1 and fake_hub.file_stats("org/tiny", name).gets == 0, name
    resumed = fake_hub.file_stats("org/tiny", big)
    assert resumed.gets == 1 and resumed.ranges == [f"bytes={kept}-"]
    assert resumed.bytes_served == len(files[big]) - kept
    assert path.name == repo.commit


def cancel_during(downloader: HubDownloader, repo_id: str, filename: str):
    """Start a download and cancel it from its own progress callback once ``filename`` has bytes on disk."""
    started, handles = threading.Event(), []

    def cancel_inside(progress):  # runs in the download thread, between two chunks of the file
        if progress.current_file == filename and progress.bytes_done > 0:
            started.wait(10)
            handles[0].cancel()

    handles.append(downloader.start(repo_id, callback=cancel_inside))
    started.set()
    with pytest.raises(DownloadCancelled):
        handles[0].wait(timeout=30)
    return handles[0]


def test_cancel_leaves_resumable_state(fake_hub, hf_env):
    files = model_files(shard_sizes=(25 * MiB,))
    fake_hub.add_repo("org/tiny", files)
    downloader = HubDownloader()
    handle = cancel_during(downloader, "org/tiny", "model.safetensors")

    assert handle.progress.state == DownloadState.CANCELLED
    blob = hf_env / "models--org--tiny" / "blobs" / hashlib.sha256(files["model.safetensors"]).hexdigest()
    partial = blob.with_name(blob.name + ".incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < len(files["model.safetensors"]) and not blob.exists()
    assert fake_hub.file_stats("org/tiny", "model.safetensors").bytes_served < len(files["model.safetensors"])
    fake_hub.reset_stats()

    resumed_events = []
    path = downloader.download("org/tiny", callback=resumed_events.append)

    assert (path / "model.safetensors").read_bytes() == files["model.safetensors"]
    stats = fake_hub.file_stats("org/tiny", "model.safetensors")
    assert stats.ranges == [f"bytes={kept}-"] and stats.bytes_served == len(files["model.safetensors"]) - kept
    first_moving = next(e for e in resumed_events if e.state == DownloadState.DOWNLOADING)
    assert first_moving.bytes_done >= kept  # progress starts from what is already on disk


def test_server_ignoring_range_restarts_the_file_instead_of_corrupting_it(fake_hub, hf_env):
    files = model_files(shard_sizes=(25 * MiB,))
    fake_hub.add_repo("org/tiny", files)
    downloader = HubDownloader()
    cancel_during(downloader, "org/tiny", "model.safetensors")
    fake_hub.ignore_range = True
    fake_hub.reset_stats()

    events = []
    path = downloader.download("org/tiny", callback=events.append)

    assert sha256(path / "model.safetensors") == hashlib.sha256(files["model.safetensors"]).hexdigest()
    stats = fake_hub.file_stats("org/tiny", "model.safetensors")
    assert len(stats.ranges) == 1 and stats.bytes_served == len(files["model.safetensors"])
    assert events[-1].bytes_done == events[-1].bytes_total


def test_gated_repo_tells_to_accept_the_license_and_set_hf_token(fake_hub, hf_env, monkeypatch):
    files = model_files()
    fake_hub.add_repo("meta/gated", files, gated=True, allowed_tokens=("hf_granted",))

    with pytest.raises(EngineError) as no_token:
        HubDownloader().download("meta/gated")
    message = no_token.value.message
    assert "gated" in message and "HF_TOKEN" in message and "license" in message
    assert f"{fake_hub.endpoint}/meta/gated" in message

    with pytest.raises(EngineError, match="not been granted access"):
        HubDownloader().download("meta/gated", token="hf_not_on_the_list")
    assert fake_hub.file_stats("meta/gated", "model.safetensors").gets == 0

    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    path = HubDownloader().download("meta/gated")
    assert (path / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert fake_hub.file_stats("meta/gated", "model.safetensors").auth_seen_on_cdn == 0  # token stays on the Hub


def test_missing_repo_says_not_found(fake_hub, hf_env):
    handle = HubDownloader().start("nobody/nothing-here")
    with pytest.raises(EngineError) as err:
        handle.wait(timeout=30)
    assert "'nobody/nothing-here' was not found" in err.value.message
    assert handle.progress.state == DownloadState.FAILED and handle.progress.error == err.value.message


def test_repo_without_safetensors_is_refused_before_any_transfer(fake_hub, hf_env):
    files = {k: v for k, v in model_files().items() if not k.endswith(".safetensors")}
    fake_hub.add_repo("old/pickles", files)

    with pytest.raises(EngineError, match="no .safetensors weights.*pickle"):
        HubDownloader().download("old/pickles")
    assert fake_hub.total_body_bytes("old/pickles") == 0  # not even config.json was fetched


def test_unsupported_architecture_is_refused_before_the_weights(fake_hub, hf_env):
    gpt2 = {**TINY_LLAMA, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    fake_hub.add_repo("openai/gpt2ish", model_files(gpt2))

    with pytest.raises(EngineError, match="unsupported architecture.*GPT2LMHeadModel"):
        HubDownloader().download("openai/gpt2ish")
    assert fake_hub.file_stats("openai/gpt2ish", "model.safetensors").gets == 0


@pytest.mark.parametrize("quant, accepted", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}, True),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, True),
    ({"quant_method": "gptq", "bits": 8, "group_size": -1}, True),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, False),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, False),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, False),
    ({"quant_method": "fp8"}, False),
])
def test_quantization_support_is_checked_before_the_weights(fake_hub, hf_env, quant, accepted):
    fake_hub.add_repo("q/model", model_files({**TINY_LLAMA, "quantization_config": quant}))
    downloader = HubDownloader()
    if accepted:
        plan = downloader.inspect("q/model")
        assert plan.quantization.startswith(quant["quant_method"].upper())
        assert plan.model_config.quantization_config == quant
    else:
        with pytest.raises(EngineError, match="unsupported quantization"):
            downloader.download("q/model")
    assert fake_hub.file_stats("q/model", "model.safetensors").gets == 0


def test_gptq_quantize_config_file_is_read_when_config_has_none(fake_hub, hf_env):
    files = model_files()
    files["quantize_config.json"] = json.dumps({"bits": 4, "group_size": 64, "desc_act": False}).encode()
    fake_hub.add_repo("old/gptq", files)
    plan = HubDownloader().inspect("old/gptq")
    assert plan.quantization == "GPTQ 4-bit (group 64)"
    assert "quantize_config.json" in {f.name for f in plan.files}


def test_not_enough_disk_space_is_refused_before_the_weights(fake_hub, hf_env):
    files = model_files(shard_sizes=(300_000,))
    fake_hub.add_repo("org/tiny", files)
    tiny_disk = HubDownloader(disk_usage=lambda path: (10**9, 10**9 - 50_000, 50_000))
    with pytest.raises(EngineError, match="not enough disk space"):
        tiny_disk.download("org/tiny")
    assert fake_hub.file_stats("org/tiny", "model.safetensors").gets == 0


def test_offline_mode_uses_the_cache_and_fails_clearly_without_it(fake_hub, hf_env, monkeypatch):
    fake_hub.add_repo("org/tiny", model_files())
    online = HubDownloader().download("org/tiny")
    requests_before = fake_hub.requests

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert HubDownloader().download("org/tiny") == online
    assert fake_hub.requests == requests_before  # nothing went to the network

    fake_hub.add_repo("org/never-fetched", model_files())
    with pytest.raises(EngineError, match="HF_HUB_OFFLINE.*not in the Hugging Face cache"):
        HubDownloader().download("org/never-fetched")
    assert fake_hub.requests == requests_before


def test_add_local_validates_folders_and_accepts_gguf_files(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    files = model_files(shard_sizes=(1000, 2000))
    for name in needed_names(files):
        (folder / name).write_bytes(files[name])
    downloader = HubDownloader(cache_dir=tmp_path / "cache", offline=True)

    local = downloader.add_local(folder)
    assert local.kind == "safetensors" and local.model_config.hidden_size == 64
    assert local.size_bytes == sum(len(files[n]) for n in needed_names(files) if n.endswith(".safetensors"))

    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(EngineError, match="missing model-00002-of-00002.safetensors"):
        downloader.add_local(folder)

    gguf = tmp_path / "smollm2.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert downloader.add_local(gguf).kind == "gguf"
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf")
    with pytest.raises(EngineError, match="not a GGUF"):
        downloader.add_local(tmp_path / "fake.gguf")
    with pytest.raises(EngineError, match="no such GGUF file"):
        downloader.add_local(tmp_path / "missing.gguf")
    with pytest.raises(EngineError, match="not a .gguf"):
        downloader.add_local(folder / "config.json")


def test_starting_a_running_download_joins_it(fake_hub, hf_env):
    files = model_files(shard_sizes=(12 * MiB,))
    fake_hub.add_repo("org/tiny", files)
    downloader = HubDownloader()
    first, second = downloader.start("org/tiny"), downloader.start("org/tiny")
    assert first is second
    assert first.wait(timeout=30) == second.wait(timeout=30)
    assert fake_hub.file_stats("org/tiny", "model.safetensors").gets == 1
    assert downloader.active() == []
