"""A GPT (and a Llama) whose stage 1 is a tensor-parallel pair, submitted over REST and trained by the real
system, each from a Hugging Face checkpoint as `transformers` saves one (bf16, sharded, its LM head tied to its token
embedding) and back out as a folder `from_pretrained` loads. The tied weight has a copy on stage 0 (the embedding)
and on both ranks of stage 1 (the head): their gradients are summed between the stages every step, so the copies
stay equal and the losses are one process's, whose one parameter gets both gradients.

Gunicorn on PostgreSQL, a Celery worker and beat on Redis, and three node agents: the reconciler puts
stage 0 on one agent and splits stage 1 (the last block and the head) over the other two, 2 of the 4
heads each. The job succeeds with the losses of single-process training, step for step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from arceus.cli import main as cli_main
from arceus.data.text_config import BUNDLED_TEXT
from arceus.model.build import build_full_model
from arceus.model.gpt.hf import hf_config as gpt_hf_config
from arceus.model.gpt.hf import hf_name as gpt_hf_name
from arceus.model.gpt.hf import hf_transposed as gpt_hf_transposed
from arceus.model.hugging_face import SHARDS_INDEX
from arceus.model.llama.hf import hf_config, hf_name
from arceus.model.registry import model_spec_from_config
from devtools.cluster import LocalCluster
from devtools.reference import reference_run

pytestmark = pytest.mark.slow


def test_a_job_with_a_tensor_parallel_stage_trains_over_rest_like_one_process(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    source = tmp_path / "genesis.txt"
    source.write_text(BUNDLED_TEXT.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    agents = cluster.start_agents([f"node-{i}" for i in range(3)])
    spec: dict[str, Any] = {
        "name": "e2e-tensor-parallel",
        "model_config": {"type": "transformer", "n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 16,
                         "tie_word_embeddings": True},
        "dataset_config": {
            "name": "text", "source": cluster.add_data_file(source), "batch_size": 16, "val_batch_size": 64
        },
        "epochs": 1,
        "learning_rate": 0.003,
        "optimizer": "adam",
        "micro_batches": 2,
        "seed": 7,
        "stages": 2,
        "tensor_parallel": {"size": 2, "stages": [1]},
        "requirements": {"owner_diversity": False},  # every agent here is one owner's
    }
    job = cluster.client.submit_job(spec)
    assert job["tensor_parallel"] == {"size": 2, "stages": [1]} and job["audit_rate"] == 0.0
    # It starts from a GPT-2 as transformers ships one: bf16, sharded, tied (its Conv1D weights transposed on the way
    # in; the head's copy is the one stored embedding).
    model_spec = model_spec_from_config(job["model_config"])
    torch.manual_seed(13)
    shipped = GPT2LMHeadModel(GPT2Config(**gpt_hf_config(model_spec))).to(torch.bfloat16)
    assert shipped.lm_head.weight is shipped.transformer.wte.weight
    shipped.save_pretrained(tmp_path / "gpt2", max_shard_size="40KB")
    weight_map = json.loads((tmp_path / "gpt2" / SHARDS_INDEX).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1 and "lm_head.weight" not in weight_map
    cluster.client.upload_initial_weights(job["id"], tmp_path / "gpt2")
    start = {f"layers.{n}": t.float() for n, t in build_full_model(model_spec, seed=0).state_dict().items()}
    theirs_start = shipped.state_dict()
    for name in start:
        weight = theirs_start[gpt_hf_name(model_spec, name)].float()
        start[name] = weight.T.contiguous() if gpt_hf_transposed(model_spec, name) else weight
    cluster.client.start_job(job["id"])

    final = cluster.client.wait(job["id"], timeout=120)

    assert final["status"] == "succeeded", (final.get("error"), final["conditions"])
    placements = [(p["stage_index"], p["rank"], p["node_id"]) for p in final["placements"]]
    assert [(i, r) for i, r, _ in placements] == [(0, 0), (1, 0), (1, 1)]
    assert {n for _, _, n in placements} == {a.node_id for a in agents}  # every rank on its own agent
    assert all(p["samples"] > 0 and p["compute_seconds"] > 0 for p in final["placements"])
    losses = [point["loss"] for point in final["loss_curve"]]
    assert final["step"] == final["total_steps"] == len(losses) > 5
    assert losses[-1] < losses[0] - 0.2
    trained = {**spec, "model_config": final["model_config"], "dataset_config": final["dataset_config"]}
    expected = reference_run(trained, initial_weights=start)
    for step, (got, want) in enumerate(zip(losses, expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: {got!r} != single-process {want!r}"
    # Both ranks of the split stage are metered and billed as contributors.
    contributors = {(c["stage_index"], c["node_id"]) for c in final["contributions"]}
    assert contributors == {(i, n) for i, _, n in placements}
    # Out again as a GPT-2 folder: transformers' logits are the trained pipeline's.
    cluster.client.save_hugging_face_model(job["id"], tmp_path / "gpt2-trained")
    cluster.client.save_model(job["id"], tmp_path / "trained.safetensors")
    trained_weights = load_file(tmp_path / "trained.safetensors")
    assert torch.equal(trained_weights["layers.0.wte.weight"], trained_weights["layers.3.lm_head.weight"])
    ours = build_full_model(model_spec, seed=0)
    ours.load_state_dict({n.removeprefix("layers."): t for n, t in trained_weights.items()})
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_spec.vocab_size, (2, model_spec.block_size), generator=generator)
    with torch.no_grad():
        exported = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2-trained").eval()
        assert exported.lm_head.weight is exported.transformer.wte.weight
        torch.testing.assert_close(exported(tokens).logits, ours(tokens), rtol=0, atol=1e-5)


def test_a_llama_fine_tunes_over_rest_split_like_one_process_and_downloads_as_a_hugging_face_folder(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A grouped-query Llama, its decoder layers a tensor-parallel pair (one key/value head each), starts from
    a Hugging Face folder as `transformers` ships one, bf16, sharded and tied (`arceus jobs weights`): the losses are
    single-process training's from those weights widened to fp32, and `arceus jobs model --format hf` gives a
    folder `transformers` loads whose logits are those of the trained weights in our own model."""
    source = tmp_path / "genesis.txt"
    source.write_text(BUNDLED_TEXT.read_text(encoding="utf-8")[:2000], encoding="utf-8")
    cluster.start_agents([f"node-{i}" for i in range(3)])
    model_config = {
        "type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16, "tie_word_embeddings": True,
    }
    spec: dict[str, Any] = {
        "name": "e2e-llama",
        "model_config": model_config,
        "dataset_config": {"name": "text", "source": cluster.add_data_file(source), "batch_size": 16},
        "epochs": 1, "learning_rate": 0.003, "optimizer": "adam", "seed": 3, "stages": 2,
        "tensor_parallel": {"size": 2, "stages": [1]},
        "requirements": {"owner_diversity": False},  # every agent here is one owner's
    }
    job = cluster.client.submit_job(spec)
    model_spec = model_spec_from_config(job["model_config"])
    # The starting weights: a transformers model of the job's config, saved in bf16 in shards with their index.
    torch.manual_seed(11)
    shipped = LlamaForCausalLM(LlamaConfig(**hf_config(model_spec))).to(torch.bfloat16)
    shipped.save_pretrained(tmp_path / "shipped", max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "shipped" / SHARDS_INDEX).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1 and "lm_head.weight" not in weight_map
    theirs_start = shipped.state_dict()
    start = {
        f"layers.{n}": theirs_start[hf_name(model_spec, f"layers.{n}")].float()
        for n in build_full_model(model_spec, seed=0).state_dict()
    }
    argv = ["--url", cluster.api_url, "--token", cluster.client.session.headers["Authorization"].removeprefix("Token ")]
    assert cli_main([*argv, "jobs", "weights", job["id"], str(tmp_path / "shipped")]) == 0
    cluster.client.start_job(job["id"])
    final = cluster.client.wait(job["id"], timeout=120)

    assert final["status"] == "succeeded", (final.get("error"), final["conditions"])
    losses = [point["loss"] for point in final["loss_curve"]]
    trained = {**spec, "model_config": final["model_config"], "dataset_config": final["dataset_config"]}
    expected = reference_run(trained, initial_weights=start)
    for step, (got, want) in enumerate(zip(losses, expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: {got!r} != single-process {want!r}"
    assert not math.isclose(losses[0], reference_run(trained, max_steps=1).losses[0], rel_tol=1e-3)  # not seeded

    folder = tmp_path / "llama-hf"
    assert cli_main([*argv, "jobs", "model", job["id"], "--format", "hf", "-o", str(folder)]) == 0
    weights = tmp_path / "trained.safetensors"
    cluster.client.save_model(job["id"], weights)
    ours = build_full_model(model_spec, seed=0)
    trained_weights = load_file(weights)
    assert torch.equal(trained_weights["layers.0.embed_tokens.weight"], trained_weights["layers.3.lm_head.weight"])
    ours.load_state_dict({name.removeprefix("layers."): t for name, t in trained_weights.items()})
    theirs = LlamaForCausalLM.from_pretrained(folder).eval()
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_spec.vocab_size, (2, model_spec.block_size), generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=1e-5)
