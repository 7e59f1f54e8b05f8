"""The data plane: one training batch from two rollout actors through the buffer to a learner.

A batch of 512 prompts x 16 rollouts, response lengths uniform in [64, 2048] tokens, each with
token ids (int32) and logprobs (float32), starts as engine output inside two rollout actors and
ends in a learner actor as arrays it can train on. Three ways, timed side by side in one run:

  arrow    (gdpo-ray) each actor builds its groups as Arrow record batches, returned once into
           Ray's object store; the driver's ArrowBuffer holds references; the learner reads the
           groups zero-copy.
  tensors  each actor builds a dict of padded torch tensors (ids int64, logprobs float32,
           attention mask int64, [N, 2048]) shipped through the object store; the learner
           concatenates the two halves (today's frameworks).
  pickle   each actor ships Python lists of dicts; the learner turns them into arrays.

Keys (``--json``): ratio_to_memcpy (bandwidth of the arrow path over one plain memory copy of
the same bytes; aim >= 0.4), speedup_vs_tensors (aim >= 3), speedup_vs_pickle (aim >= 10).

    python benchmarks/data_plane.py [--json] [--prompts 512] [--repeats 3] [--smoke]

``--smoke``: 8 prompts, one repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
G, MAX_LEN = 16, 2048

from benchmarks._smoke import parse_args  # noqa: E402


class Producer:
    """Holds engine-like output (not timed), and ships it three ways (timed)."""

    def __init__(self, prompts: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.lengths = rng.integers(64, MAX_LEN + 1, size=(prompts, G))
        self.ids = [[rng.integers(0, 50_000, n, dtype=np.int32) for n in row] for row in self.lengths]
        self.logprobs = [[-rng.random(n, dtype=np.float32) for n in row] for row in self.lengths]

    def payload_bytes(self) -> int:
        return int(self.lengths.sum()) * 8

    def arrow(self):
        from gdpo_ray.batch import GroupData, build_groups, group_bounds

        groups = [GroupData(
            prompt_id=f"{self.seed}-{p}", group_id=f"{self.seed}-{p}/e0/a0",
            prompt_token_ids=np.arange(32), response_token_ids=ids, response_logprobs=lps,
            finish_reasons=["stop"] * G, policy_version=0, rewards=np.zeros((G, 2)),
            reward_errors=[["", ""]] * G) for p, (ids, lps) in enumerate(zip(self.ids, self.logprobs))]
        batch = build_groups(groups, ["a", "b"])
        return [(gid, a, b, 0) for gid, a, b in group_bounds(batch)], batch

    def tensors(self):
        import torch

        n = self.lengths.size
        ids = torch.zeros((n, MAX_LEN), dtype=torch.int64)
        lps = torch.zeros((n, MAX_LEN), dtype=torch.float32)
        mask = torch.zeros((n, MAX_LEN), dtype=torch.int64)
        flat_ids = [x for row in self.ids for x in row]
        flat_lps = [x for row in self.logprobs for x in row]
        for i, (a, b) in enumerate(zip(flat_ids, flat_lps)):
            ids[i, :len(a)] = torch.from_numpy(a)
            lps[i, :len(b)] = torch.from_numpy(b)
            mask[i, :len(a)] = 1
        return {"input_ids": ids, "rollout_logprobs": lps, "attention_mask": mask}

    def pickle(self):
        return [{"prompt_id": f"{self.seed}-{p}", "sample_index": j,
                 "response_token_ids": self.ids[p][j].tolist(),
                 "response_logprobs": self.logprobs[p][j].tolist()}
                for p in range(len(self.ids)) for j in range(G)]


class Learner:
    def arrow(self, refs) -> int:
        from gdpo_ray.groups import read_rows

        tokens = 0
        for batch in read_rows(refs):
            ids = batch.column("response_token_ids").flatten().to_numpy()  # zero-copy views
            lps = batch.column("response_logprobs").flatten().to_numpy()
            assert len(ids) == len(lps)
            tokens += len(ids)
        return tokens

    def tensors(self, refs) -> int:
        import ray
        import torch

        parts = ray.get(list(refs))
        batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        return int(batch["attention_mask"].sum())

    def pickle(self, refs) -> int:
        import ray

        parts = ray.get(list(refs))
        rows = [r for part in parts for r in part]
        ids = np.concatenate([np.asarray(r["response_token_ids"], np.int32) for r in rows])
        lps = np.concatenate([np.asarray(r["response_logprobs"], np.float32) for r in rows])
        assert len(ids) == len(lps)
        return len(ids)


def run(args) -> dict:
    import ray

    from actors.buffer import ArrowBuffer
    from gdpo_ray.groups import GroupRef

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=6 * 1024**3,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    half = args.prompts // 2
    producers = [ray.remote(Producer).options(num_cpus=1).remote(half, seed) for seed in (1, 2)]
    learner = ray.remote(Learner).options(num_cpus=1).remote()
    total_bytes = sum(ray.get([p.payload_bytes.remote() for p in producers]))
    expected_tokens = total_bytes // 8

    def arrow_path() -> int:
        buffer = ArrowBuffer(groups_per_step=args.prompts, max_staleness=0)
        calls = [p.arrow.options(num_returns=2).remote() for p in producers]
        for meta_ref, table_ref in calls:
            buffer.add([GroupRef(table_ref, a, b, gid, v) for gid, a, b, v in ray.get(meta_ref)])
        return ray.get(learner.arrow.remote(buffer.take(args.prompts)))

    def tensors_path() -> int:
        return ray.get(learner.tensors.remote([p.tensors.remote() for p in producers]))

    def pickle_path() -> int:
        return ray.get(learner.pickle.remote([p.pickle.remote() for p in producers]))

    payload = np.ones(total_bytes, np.uint8)
    target = np.empty_like(payload)
    times = {"arrow": [], "tensors": [], "pickle": [], "memcpy": []}
    for _ in range(args.repeats):  # interleaved, so that noise hits every path alike
        for name, fn in (("arrow", arrow_path), ("tensors", tensors_path), ("pickle", pickle_path)):
            start = time.perf_counter()
            tokens = fn()
            times[name].append(time.perf_counter() - start)
            if name != "tensors":
                assert tokens == expected_tokens, (name, tokens, expected_tokens)
        start = time.perf_counter()
        np.copyto(target, payload)
        times["memcpy"].append(time.perf_counter() - start)
    ray.shutdown()
    best = {k: min(v) for k, v in times.items()}
    return {
        "payload_mb": total_bytes / 1e6,
        "arrow_s": best["arrow"], "tensors_s": best["tensors"], "pickle_s": best["pickle"],
        "memcpy_s": best["memcpy"],
        "ratio_to_memcpy": best["memcpy"] / best["arrow"],
        "speedup_vs_tensors": best["tensors"] / best["arrow"],
        "speedup_vs_pickle": best["pickle"] / best["arrow"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_args(parser, {"prompts": 8, "repeats": 1})
    r = run(args)
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in r.items()} | {"smoke": args.smoke}))
        return
    print(f"One batch: {args.prompts} prompts x {G} rollouts, {r['payload_mb']:.0f} MB of ids + "
          f"logprobs, two rollout actors -> buffer -> learner (best of {args.repeats})")
    print(f"  arrow (gdpo-ray) {r['arrow_s']:7.3f} s   memcpy of the bytes {r['memcpy_s']:.3f} s"
          f"   -> {r['ratio_to_memcpy']:.2f} of memcpy bandwidth")
    print(f"  padded tensors   {r['tensors_s']:7.3f} s   -> arrow is {r['speedup_vs_tensors']:.1f}x faster")
    print(f"  pickled lists    {r['pickle_s']:7.3f} s   -> arrow is {r['speedup_vs_pickle']:.1f}x faster")


if __name__ == "__main__":
    main()
