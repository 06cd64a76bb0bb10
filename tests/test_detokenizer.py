"""Incremental detokenizer: streamed text equals a full decode, never a broken character, stop strings are
caught across token boundaries and never partly emitted, special tokens skipped, O(new tokens) per call."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer, detokenize_full

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x  +  1\n", "Hello,   world!",
    "  leading spaces", "tabs\tand\nnewlines\n\n", "It's 3.14, isn't it?", "café crème brûlée",
    "naïve façade Ærøskøbing", "Ångström señor", "😀", "👍🏽 nice", "🇫🇷 flag", "family 👨‍👩‍👧", "🎉🎉🎉",
    "你好世界", "日本語のテキスト", "한국어 문장", "中文，标点。", "Привет мир", "مرحبا بالعالم", "∑ x² ≤ ∞",
    "\u00a0nbsp", "emoji in a row 🤖🦀🐍", " 🍣寿司 and ramen 🍜",
]
IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> and <|im_end|>
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def random_ids(tokenizer, rng: random.Random, specials: bool = False) -> list[int]:
    """Token ids of random real text: either one encoded string or encoded pieces glued together."""
    pieces = rng.choices(CORPUS, k=rng.randint(1, 8))
    if rng.random() < 0.5:
        return tokenizer.encode(" ".join(pieces), add_special_tokens=False)
    ids: list[int] = []
    for piece in pieces:
        ids += tokenizer.encode(piece, add_special_tokens=False)
        if specials and rng.random() < 0.3:
            ids.append(rng.choice([IM_START, IM_END]))
    return ids


def random_prompt(tokenizer, rng: random.Random) -> list[int]:
    kind = rng.randrange(3)
    if kind == 0:
        return []
    if kind == 1:
        return [IM_START] + tokenizer.encode("assistant\n", add_special_tokens=False)
    return tokenizer.encode(rng.choice(CORPUS), add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    """Feed ids one at a time, or in random chunks when ``rng`` is given; the flush is the last delta."""
    deltas, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 4) if rng else 1
        deltas.append(detok.add_tokens(ids[i:i + size]) if rng else detok.add_token(ids[i]))
        i += size
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_full_decode(tokenizer, skip_special_tokens):
    saw_partial_character = False
    for seed in range(150):
        rng = random.Random(seed)
        ids = random_ids(tokenizer, rng, specials=True)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert REPLACEMENT not in expected
        detok = IncrementalDetokenizer(tokenizer, random_prompt(tokenizer, rng),
                                       skip_special_tokens=skip_special_tokens)
        deltas = stream(detok, ids, rng if seed % 2 else None)
        assert "".join(deltas) == expected == detok.text
        assert deltas[-1] == ""  # the text ends on a whole character: nothing was held back needlessly
        assert all(REPLACEMENT not in delta for delta in deltas)
        assert detok.text == detokenize_full(tokenizer, ids, skip_special_tokens)
        saw_partial_character |= any(REPLACEMENT in tokenizer.decode([i]) for i in ids)
    assert saw_partial_character  # byte-fallback tokens were really exercised


def test_partial_characters_are_held_until_complete(tokenizer):
    ids = tokenizer.encode(" 你好 😀 déjà 🇫🇷", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    complete = ""  # the text of the longest run of tokens that ends on a whole character
    num_held = 0
    for k, token_id in enumerate(ids, start=1):
        delta = detok.add_token(token_id)
        assert REPLACEMENT not in delta
        so_far = tokenizer.decode(ids[:k])
        if not so_far.endswith(REPLACEMENT):
            complete = so_far
        num_held += so_far.endswith(REPLACEMENT)
        assert detok.text == complete
    assert num_held >= 4
    assert detok.flush() == ""


def test_flush_releases_an_unfinished_character_like_a_full_decode(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = stream(detok, ids)
    assert all(REPLACEMENT not in d for d in deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids)


def test_prompt_cut_inside_a_character(tokenizer):
    ids = tokenizer.encode("Look: 😀🎉 done", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT))
    prompt, output = ids[:cut], ids[cut:]
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), output)
    # The stray bytes show as U+FFFD, exactly as a full decode of the output shows them, and the rest is intact.
    assert "".join(deltas) == tokenizer.decode(output)
    assert "".join(deltas).endswith("🎉 done")


def test_prompt_context_keeps_the_first_tokens_space():
    """SentencePiece-style decoders drop the first token's leading space; decoding after a few prompt tokens
    gives the text as it continues the prompt (what vLLM and OpenAI completions return)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3, "\u2581The": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    metaspace = PreTrainedTokenizerFast(tokenizer_object=backend)
    prompt, output = [4], [1, 2, 3]
    in_context = metaspace.decode(prompt + output)[len(metaspace.decode(prompt)):]
    assert in_context == " Hello world!"
    assert "".join(stream(IncrementalDetokenizer(metaspace, prompt), output)) == in_context
    assert "".join(stream(IncrementalDetokenizer(metaspace, []), output)) == metaspace.decode(output)


# --- stop strings ----------------------------------------------------------------------------------------------------

def expected_stop(full: str, stops: list[str], min_text: int = 0) -> tuple[int, str] | None:
    """Reference: the stop occurrence that ends first (ties: the longer one), ending after ``min_text``."""
    found = []
    for stop in stops:
        start = full.find(stop, max(0, min_text - len(stop) + 1))
        if start >= 0:
            found.append((start + len(stop), start, stop))
    return min(found)[1:] if found else None


def check_stop_stream(tokenizer, ids, stops, include, rng=None, min_tokens=0):
    full = tokenizer.decode(ids)
    min_text = len(tokenizer.decode(ids[:min_tokens])) if min_tokens else 0
    match = expected_stop(full, stops, min_text)
    if match is None:
        final = full
    else:
        start, stop = match
        final = full[:start + len(stop)] if include else full[:start]
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops, include_stop_str_in_output=include,
                                   min_tokens=min_tokens)
    released = ""
    for k, token_id in enumerate(ids, start=1):
        released += detok.add_token(token_id)
        assert final.startswith(released)  # never a piece of the stop string (nor text after it)
        so_far = tokenizer.decode(ids[:k])
        if detok.stop_string is None and not so_far.endswith(REPLACEMENT):
            held = so_far[len(released):]  # only a tail that may still become a stop string waits
            assert so_far.startswith(released)
            assert held == "" or any(len(s) > len(held) and s.startswith(held) for s in stops)
    released += detok.flush()
    assert released == final == detok.text
    assert detok.stop_string == (match[1] if match else None)
    assert detok.add_token(ids[0]) == "" and detok.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings_across_token_boundaries(tokenizer, include):
    spanning = 0
    for seed in range(120):
        rng = random.Random(1000 + seed)
        ids = random_ids(tokenizer, rng)
        full = tokenizer.decode(ids)
        if len(full) < 4:
            continue
        start = rng.randrange(1, len(full) - 1)
        stop = full[start:start + rng.randint(1, 6)]
        stops = [stop] + ([rng.choice(CORPUS)[:4]] if rng.random() < 0.3 else [])
        check_stop_stream(tokenizer, ids, stops, include)
        token_texts = [tokenizer.decode([i]) for i in ids]
        spanning += len(stop) > 1 and not any(stop in t for t in token_texts)
    assert spanning > 20  # most stop strings really straddle tokens


def test_stop_string_held_back_then_released_when_it_does_not_complete(tokenizer):
    stops = ["STOP!"]
    ids = tokenizer.encode("Say ST then STOP now", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
    for k, token_id in enumerate(ids, start=1):
        detok.add_token(token_id)
        so_far = tokenizer.decode(ids[:k])
        held = so_far[len(detok.text):]
        assert so_far.startswith(detok.text)
        assert held == "" or any(s.startswith(held) and len(s) > len(held) for s in stops)
    assert detok.stop_string is None
    assert detok.text + detok.flush() == "Say ST then STOP now"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_cut(tokenizer, include):
    text = "The answer is 42. STOP here, 你好世界 then more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop in ["STOP", "42. ST", "好世", "世界 t"]:
        assert not any(stop in tokenizer.decode([i]) for i in ids)
        check_stop_stream(tokenizer, ids, [stop], include)
    # Chunked delivery gives the same result as token-by-token.
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP"], include_stop_str_in_output=include)
    assert "".join(stream(detok, ids, random.Random(3))) == ("The answer is 42. STOP" if include
                                                             else "The answer is 42. ")


def test_first_ending_stop_string_wins(tokenizer):
    ids = tokenizer.encode("abcdefgh", add_special_tokens=False)
    for chunked in (None, random.Random(1)):
        detok = IncrementalDetokenizer(tokenizer, [], stop=["bcdefg", "de"])
        assert "".join(stream(detok, ids, chunked)) == "abc" and detok.stop_string == "de"


def test_min_tokens_defers_stop_strings(tokenizer):
    ids = tokenizer.encode(" is Lee, and I'm a student in the college of engineering", add_special_tokens=False)
    for min_tokens in (0, 2, 5):
        check_stop_stream(tokenizer, ids, ["e"], include=False, min_tokens=min_tokens)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["e"], min_tokens=5)
    assert len("".join(stream(detok, ids))) > len(tokenizer.decode(ids[:5]))


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = ([IM_START] + tokenizer.encode("assistant\nHi there", add_special_tokens=False) + [IM_END]
           + tokenizer.encode(" 🙂", add_special_tokens=False) + [IM_END])
    skipped = "".join(stream(IncrementalDetokenizer(tokenizer, [IM_START]), ids))
    assert skipped == "assistant\nHi there 🙂"
    kept = "".join(stream(IncrementalDetokenizer(tokenizer, [IM_START], skip_special_tokens=False), ids))
    assert kept == tokenizer.decode(ids, skip_special_tokens=False)
    assert kept.count("<|im_end|>") == 2 and kept.startswith("<|im_start|>")


# --- cost -------------------------------------------------------------------------------------------------------

class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids, **kwargs):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_each_call_decodes_only_a_small_window(tokenizer):
    ids = tokenizer.encode(" ".join(CORPUS * 8), add_special_tokens=False)
    assert len(ids) > 1500
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, tokenizer.encode("A prompt", add_special_tokens=False),
                                   stop=["never appears"])
    text = "".join(stream(detok, ids))
    assert text == tokenizer.decode(ids)
    assert max(counting.window_sizes) <= 12
    assert sum(counting.window_sizes) < 6 * len(ids)


def test_engine_tokenizer_decode_equals_transformers_decode(default_model_dir):
    """Tokenizer.decode skips transformers' wrapper (a per-step cost at high batch) without changing the text."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    rng = random.Random(3)
    ids = tok.encode("Grüße, 世界! 😀 def f(x):\n\treturn x ** 2  # spaces   kept " * 4)
    ids += [rng.randrange(tok.vocab_size) for _ in range(600)]
    for _ in range(400):
        a = rng.randrange(len(ids))
        b = rng.randrange(a, min(len(ids), a + 12) + 1)
        for skip in (True, False):
            assert tok.decode(ids[a:b], skip) == tok.hf.decode(ids[a:b], skip_special_tokens=skip)


def test_engine_tokenizer_loads_the_named_class_like_auto_tokenizer(default_model_dir, tokenizer, tmp_path):
    """The engine skips AutoTokenizer when tokenizer_config.json names the class (start-up time) and falls back
    to it when no class is named; either way encodings and the chat template come out the same."""
    import json
    import shutil
    from pathlib import Path

    from engine.tokenizer import Tokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "café 😀 你好?"}]
    expected_chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    named = Tokenizer(Path(default_model_dir))
    assert type(named.hf).__name__ == json.loads(
        (Path(default_model_dir) / "tokenizer_config.json").read_text())["tokenizer_class"]

    unnamed_dir = tmp_path / "unnamed"
    unnamed_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "config.json"):
        if (Path(default_model_dir) / name).is_file():
            shutil.copy(Path(default_model_dir) / name, unnamed_dir / name)
    config = json.loads((unnamed_dir / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class")
    (unnamed_dir / "tokenizer_config.json").write_text(json.dumps(config))
    unnamed = Tokenizer(unnamed_dir)

    for tok in (named, unnamed):
        for text in CORPUS:
            assert tok.encode(text) == tokenizer(text)["input_ids"], text
        assert tok.apply_chat_template(messages) == expected_chat
        assert tok.eos_token_id == tokenizer.eos_token_id


def test_engine_tokenizer_does_not_import_the_auto_classes(default_model_dir):
    """Start-up time: with the class named, loading never imports transformers' auto-tokenizer module (whose
    import chain reached torch._dynamo and torch.distributed on transformers 5.17)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from pathlib import Path; from engine.tokenizer import Tokenizer; "
            f"Tokenizer(Path({str(default_model_dir)!r})); "
            "print('transformers.models.auto.tokenization_auto' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
