"""The tiny model shipped in assets/ loads in transformers and in esroll with the same logits, and is small."""

from pathlib import Path

import numpy as np
import torch
import transformers

from esroll.data import PLAIN_TEMPLATE
from esroll.models import forward, load_hf

ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen3-arith"


def test_shipped_model_loads_in_both():
    assert sum(f.stat().st_size for f in ASSET.iterdir()) < 25 * 2**20
    tok = transformers.AutoTokenizer.from_pretrained(str(ASSET))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ASSET), dtype=torch.float32).eval()
    ids = tok(PLAIN_TEMPLATE.format(question="What is 12 + 35?"), return_tensors="np").input_ids
    cfg, params = load_hf(ASSET)
    ours, _ = forward(cfg, params, ids)
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(ours) - ref).max() < 1e-4
    # Digits are single tokens, so answers are spelled digit by digit.
    assert [tok.decode([t]) for t in tok(" 47").input_ids] == [" ", "4", "7"]
