"""The developer's side of tests/e2e/test_sdk_discovery.py, run inside a network namespace: the README's
`DistributedTrainer` example with nothing configured but the API token. Prints one `PEERS {json}` line, then
one `TRAINED {json}` line, and writes the trained `trainer.model`'s parameters to OUT; with --again it then
trains once more (the test interrupts that run with SIGINT)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from safetensors.torch import save_file

from arceus import DistributedTrainer
from arceus.model.build import named_global_parameters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", help="JSON: model_config, dataset_config and the other job fields")
    parser.add_argument("out", type=Path)
    parser.add_argument("--again", action="store_true")
    args = parser.parse_args()
    job = json.loads(args.job)
    model, dataset = job.pop("model_config"), job.pop("dataset_config")

    trainer = DistributedTrainer(model=model, discovery_method="auto", partition_strategy="hybrid",
                                 fault_tolerance=True)
    peers = trainer.discover_peers()
    print("PEERS", json.dumps({**dataclasses.asdict(peers), "ready_devices": peers.ready_devices}), flush=True)
    history = trainer.train(dataset=dataset, epochs=1, checkpoint_interval=5, **job)
    assert trainer.model is not None
    save_file({name: p.detach().contiguous() for name, p in named_global_parameters(trainer.model)}, args.out)
    print("TRAINED", json.dumps({"job_id": history.job_id, "steps": history.steps, "losses": history.losses}),
          flush=True)
    if args.again:
        trainer.train(dataset=dataset, epochs=50, **job)


if __name__ == "__main__":
    main()
