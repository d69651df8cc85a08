"""experiments.plan: an ES step compiled for a TPU slice that is not there (deviceless AOT, libtpu from the `plan`
extra), and the model shapes it plans for."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from esroll.errors import InputError
from experiments.plan import model_shapes

from conftest import REPO, SHIPPED_MODEL

GiB = 1024**3


def test_model_shapes_come_from_a_local_config_or_a_preset():
    cfg, source = model_shapes(SHIPPED_MODEL)
    assert source.endswith("config.json") and cfg.hidden_size > 0
    cfg, source = model_shapes("Qwen/Qwen3-8B")  # a Hub id: the preset of that name, nothing downloaded
    assert source == "preset qwen3-8b" and (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (36, 4096, 151936)
    with pytest.raises(InputError, match=r"^config: 'model.path' = 'someone/else': no local config.json and no preset"):
        model_shapes("someone/else")


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install -e '.[plan]')")
def test_plan_compiles_the_es_step_for_a_tpu_slice_without_one(tmp_path):
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "experiments.plan", "--config", "configs/default.py:quick", "--topology", "v5e:2x2"]
    run = subprocess.run([*cmd, "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    plan = json.loads(out.read_text())
    assert plan["platform"] == "tpu" and plan["device_kind"] == "TPU v5 lite"
    assert plan["mesh_shape"] == {"data": 4, "model": 1}
    assert plan["device_memory_bytes"] == 16 * GiB
    assert [p["name"] for p in plan["programs"]] == ["cast", "ask", "tell", "generate", "evaluate"]
    assert all(p["peak_bytes"] > 0 for p in plan["programs"])
    gen = next(p for p in plan["programs"] if p["name"] == "generate")
    assert gen["other_resident_bytes"] == plan["resident"]["masters"] + plan["resident"]["optimizer state"]
    assert 0 < plan["peak_bytes_per_device"] < 16 * GiB and plan["fits"] is True
    assert plan["rows_per_step"] == 8 * 4 and plan["rows_per_device"] == 8 and plan["chunks"] == 1
    assert plan["eval_rows_per_device"] == 8
    assert "fits" in run.stdout.splitlines()[-1]


def test_grpo_plan_on_this_machine():
    """The GRPO step's programs compiled for a local CPU device: the update of one minibatch (its microbatch rows
    padded to the data axis) beside the sampling and evaluation chunks; a CPU reports no memory limit."""
    from esroll import parallel
    from esroll.methods import plan_step

    from conftest import quick_config

    cfg = quick_config("grpo_quick")
    model_cfg, _ = model_shapes(cfg.model.path)
    plan = plan_step(cfg, model_cfg, parallel.make_mesh(1), platform="cpu", prompt_len=16)
    assert [p.name for p in plan.programs] == ["cast", "update", "generate", "evaluate"]
    assert plan.rows_per_step == 4 * 4 and plan.chunks == 1 and plan.fits is None
    update = plan.programs[1]
    assert update.argument_bytes >= plan.resident["masters"] + plan.resident["optimizer state"]
    assert plan.peak_bytes_per_device >= update.temp_bytes > 0


def test_a_ppo_plan_compiles_the_critic_beside_the_policy():
    """With a critic (`grpo.advantage = "gae"`), the plan adds its values over the step's rows and its update on one
    minibatch; the policy's masters and optimizer state live beside each, the critic's own bytes in its arguments,
    and the resident optimizer state holds the critic (the policy's trunk and a 1-column head) and its Adam moments;
    with `shared_trunk`, the head and its moments alone."""
    from esroll import parallel
    from esroll.methods import plan_step

    from conftest import quick_config

    grpo = quick_config("grpo_quick")
    ppo = quick_config("grpo_quick", grpo={"advantage": "gae"})
    model_cfg, _ = model_shapes(ppo.model.path)
    mesh = parallel.make_mesh(1)
    plain = plan_step(grpo, model_cfg, mesh, platform="cpu", prompt_len=16)
    plan = plan_step(ppo, model_cfg, mesh, platform="cpu", prompt_len=16)
    assert [p.name for p in plan.programs] == [
        "cast",
        "update",
        "critic values",
        "critic update",
        "generate",
        "evaluate",
    ]
    masters = plan.resident["masters"]
    critic = plan.resident["optimizer state"] - plain.resident["optimizer state"]
    lm_head = 0 if model_cfg.tie_word_embeddings else model_cfg.vocab_size * model_cfg.hidden_size * 4
    trunk = masters - lm_head
    critic_bytes = trunk + (model_cfg.hidden_size + 1) * 4
    assert critic == 3 * critic_bytes + 4  # the critic, Adam's two moments, Adam's step count (int32)
    for p in plan.programs[2:4]:
        assert p.other_resident_bytes == masters + plan.resident["optimizer state"] - critic
        assert p.argument_bytes >= critic_bytes and p.temp_bytes > 0
    # A value head on the policy's trunk: the resident state adds the head and its moments only; both programs still
    # compile, reading the trunk from the masters.
    shared = quick_config("grpo_quick", grpo={"advantage": "gae", "adv": {"gae": {"shared_trunk": True}}})
    plan = plan_step(shared, model_cfg, mesh, platform="cpu", prompt_len=16)
    head = (model_cfg.hidden_size + 1) * 4
    assert plan.resident["optimizer state"] - plain.resident["optimizer state"] == 3 * head + 4
    assert [p.name for p in plan.programs][2:4] == ["critic values", "critic update"]
    assert all(p.argument_bytes >= trunk and p.temp_bytes > 0 for p in plan.programs[2:4])


def test_a_dae_plan_compiles_its_wider_critic():
    """DAE's critic (`configs/agents.py:quick,dae`, its heads on the policy's trunk) has a value and 8 action scores
    per position: the resident state adds a head of 9 columns and its two moments; its update compiles on readings of
    2 × 9 channels per position (`esroll.grpo.ppo.dae_readings`)."""
    from configs import agents
    from esroll import parallel
    from esroll.config import from_config_dict
    from esroll.methods import plan_step

    def plan(method, **adv):
        cd = agents.get_config(f"quick,{method}")
        cd.model.path = str(REPO / cd.model.path)
        cd.grpo.adv.update(adv)
        cfg = from_config_dict(cd.to_dict())
        return plan_step(cfg, model_shapes(cfg.model.path)[0], parallel.make_mesh(1), platform="cpu", prompt_len=16)

    plain, dae = plan("grpo"), plan("dae", dae={"shared_trunk": True})
    assert [p.name for p in dae.programs][2:4] == ["critic values", "critic update"]
    D = model_shapes(str(REPO / "assets/tiny-qwen3-agent"))[0].hidden_size
    assert dae.resident["optimizer state"] - plain.resident["optimizer state"] == 3 * (D + 1) * 9 * 4 + 4
    assert all(p.temp_bytes > 0 for p in dae.programs[2:4])


def test_topology_without_libtpu_names_the_install_line(monkeypatch):
    from esroll.plan import topology_mesh

    monkeypatch.setitem(sys.modules, "libtpu", None)  # find_spec answers None for a None entry
    with pytest.raises(ValueError, match=r"^--topology=v5e:2x2: .*needs libtpu.*pip install -e '\.\[plan\]'$"):
        topology_mesh("v5e:2x2", 1)


def test_grpo_plan_chooses_the_cheapest_remat_policy_that_fits(monkeypatch):
    """With `choose_remat`, the update is compiled under each policy, cheapest first: saving every layer's
    activations ("none") needs more temporaries, in all and per layer, than recomputing each layer ("full"). With
    a device limit between the two peaks, the choice is the first policy (in that order) whose peak is under it."""
    from esroll import memory, parallel
    from esroll.methods import plan_step

    from conftest import quick_config

    cfg = quick_config("grpo_quick")
    model_cfg, _ = model_shapes(cfg.model.path)
    mesh = parallel.make_mesh(1)
    plan = plan_step(cfg, model_cfg, mesh, platform="cpu", prompt_len=16, choose_remat=True)
    options = plan.remat
    from esroll.models.transformer import REMAT_POLICIES

    assert list(options) == ["none", "dots", "full"] and set(options) == set(REMAT_POLICIES)
    none, full = options["none"], options["full"]
    assert none["temp_bytes"] > full["temp_bytes"] and none["temp_bytes_per_layer"] > full["temp_bytes_per_layer"]
    assert plan.remat_choice is None and all(o["fits"] is None for o in options.values())  # a CPU reports no limit

    limit = (none["peak_bytes"] + full["peak_bytes"]) // 2
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: limit)
    plan = plan_step(cfg, model_cfg, mesh, platform="cpu", prompt_len=16, choose_remat=True)
    fitting = [name for name, o in plan.remat.items() if o["peak_bytes"] <= limit]
    assert plan.remat["none"]["fits"] is False and plan.remat["full"]["fits"] is True
    assert plan.remat_choice == fitting[0] != "none"
