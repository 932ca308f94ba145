"""Regenerate docs/tutorial.md and its pictures (docs/img/*.svg) from real simcluster runs.

    python docs/make_tutorial.py

Everything below is computed: the explain excerpts, the pictures, the byte counts and the
safe ranges come from running torch's own hooks in the simulator (seed 0). The output is
deterministic: running it twice gives identical files.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, quantization_hooks  # noqa: E402

from simcluster.checking.defaults import powersgd_state  # noqa: E402
from simcluster.teaching.explain import explain_story  # noqa: E402
from simcluster.teaching.safe_range import safe_range  # noqa: E402
from simcluster.teaching.story import Story, record  # noqa: E402
from simcluster.teaching.timeline import write_timeline  # noqa: E402
from simcluster.teaching.wire import PRESETS  # noqa: E402

from simcluster.hooks import legacy  # noqa: E402

NET = PRESETS["ethernet25"]
IMG = ROOT / "docs" / "img"
PS = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook:powerSGD_hook"


def picture(story: Story, name: str, title: str) -> str:
    write_timeline(story, str(IMG / f"{name}.svg"), NET, title=title)
    return f"![{title}](img/{name}.svg)"


def excerpt(text: str, start: str, end: str | None = None, *, after: str = "") -> str:
    """The lines of ``text`` from the first containing ``start`` (after the first containing ``after``)
    up to (not including) ``end``; this checkout's paths shortened so the page does not depend on them."""
    # torch's folder first: a virtual environment may lie inside the checkout
    text = text.replace(str(Path(torch.__file__).parent.parent) + "/", "").replace(str(ROOT) + "/", "")
    lines = text.splitlines()
    first = next((k for k, line in enumerate(lines) if after and after in line), 0)
    i = next(k for k, line in enumerate(lines[first:], first) if start in line)
    j = next((k for k, line in enumerate(lines[i + 1:], i + 1) if end and end in line), len(lines))
    return "```\n" + "\n".join(lines[i:j]).rstrip() + "\n```"


def part_compression() -> list[str]:
    plain = record(default_hooks.allreduce_hook, world_size=2, steps=2)
    fp16 = record(default_hooks.fp16_compress_hook, world_size=2, steps=2)
    text_plain, _ = explain_story(plain, label="allreduce_hook")
    text_fp16, _ = explain_story(fp16, label="fp16_compress_hook")
    return [
        "## 1. allreduce_hook against fp16_compress_hook",
        "",
        "`simcluster explain torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook` runs the hook",
        "for two DDP steps on the default model (`2x2,3,3`, a 12-byte bucket cap). Step 0 is one bucket in",
        "parameter order; then DDP rebuilds the buckets in gradient-ready order, and from step 1 three buckets",
        "can be in flight together: a rank's backward() goes on to its next bucket while the collectives it",
        "posted run — and one may finish meanwhile, as on a real cluster (the seeded schedule decides; in",
        "order, every rank calls the hook for all three buckets before any all_reduce completes).",
        "",
        excerpt(text_plain, "== step 1", "2. What each rank"),
        "",
        "That last line is read from the trace. A hook that waits inside for its own collective (a",
        "synchronous `dist.all_reduce`, `isend`/`irecv` then `wait()`) completes bucket 0's",
        "collective before DDP can call it for bucket 1, and explain says so instead: `the hook waits",
        "inside for its collectives: bucket 0's collective completed before rank 1's hook was called",
        "for bucket 1, so the 3 buckets went one at a time (no overlap of their communication)`.",
        "",
        "Every explanation opens with how to read it: what real DDP does around the hook, measured on",
        "torch 2.13 with gloo ([ddp-facts.md](ddp-facts.md), [gloo-facts.md](gloo-facts.md)) — and what the",
        "simulation leaves out:",
        "",
        excerpt(text_plain, "How to read this", "== step 0"),
        "",
        "The same step under `fp16_compress_hook`: each all_reduce carries float16, half the bytes of the plain",
        "hook on the same buckets, and with these small whole numbers the result is still exact:",
        "",
        excerpt(text_fp16, "4. The collectives and the bytes on the wire", "5. What each future", after="== step 1"),
        "",
        picture(plain, "allreduce_hook", "allreduce_hook, 2 ranks, gloo: step 0, rebuild, step 1"),
        "",
        picture(fp16, "fp16_compress_hook", "fp16_compress_hook, 2 ranks, gloo"),
        "",
        "Read the pictures left to right in *logical* time (one column per traced event): grey bars are hook",
        "calls, coloured bars run from a rank's post to the collective's completion (the vertical line), green",
        "boxes are callbacks on the gloo worker lane that ran them. Completion order is the seeded scheduler's;",
        "each gloo rank sees completions at its own moment. The bottom lane is the second time axis: each",
        f"collective's α-β cost under `{NET.describe()}`, one collective at a time.",
        "",
    ]


def part_powersgd() -> list[str]:
    shapes, cap = ((16, 16), (16, 16)), 1024 / 2**20
    nccl = record(powerSGD_hook.powerSGD_hook, world_size=2, backend="nccl", state=powersgd_state,
                  shapes=shapes, bucket_cap_mb=cap, steps=3)
    gloo = record(powerSGD_hook.powerSGD_hook, world_size=2, backend="gloo", state=powersgd_state,
                  shapes=shapes, bucket_cap_mb=cap, steps=3)
    text_nccl, _ = explain_story(nccl, label="powerSGD_hook")
    text_gloo, _ = explain_story(gloo, label="powerSGD_hook")
    memory = [f"rank {r}: error-feedback memory for {len(s.error_dict)} bucket(s), "
              + ", ".join(f"bucket {k}: |e| = {float(e.norm()):.4g}" for k, e in sorted(s.error_dict.items()))
              for r, s in enumerate(nccl.states)]
    return [
        "## 2. PowerSGD: the switch, the error-feedback memory, and the gloo deadlock",
        "",
        "With `--state simcluster.checking.defaults:powersgd_state` (rank 1, `start_powerSGD_iter=2`, error feedback and",
        "warm start on), PowerSGD all-reduces the plain gradients in iterations 0 and 1 and compresses from",
        "iteration 2. Two 16x16 parameters, a 1 KiB cap: two buckets after the rebuild. (A 4x4 matrix would not",
        "be compressed at all: rank 1 costs 4 + 4 numbers, and PowerSGD wants a 2x saving.) On the NCCL model:",
        "",
        f"```\nsimcluster explain {PS} --state simcluster.checking.defaults:powersgd_state --params 16x16,16x16 "
        "--bucket-cap-mb 0.0009765625 --steps 3 --backend nccl\n```",
        "",
        "Iteration 1 (after the rebuild) is still a plain all_reduce of each bucket:",
        "",
        excerpt(text_nccl, "4. The collectives and the bytes on the wire", "5. What each future", after="== step 1"),
        "",
        "Iteration 2 switches to compression:",
        "",
        excerpt(text_nccl, "== step 2", "2. What each rank"),
        "",
        excerpt(text_nccl, "4. The collectives and the bytes on the wire", "5. What each future", after="== step 2"),
        "",
        "Eight times fewer bytes than plain all_reduce, but six collectives where plain all_reduce needs two",
        "(the empty ones carry the uncompressed 1-D tensors: none here): for buckets this small the α term",
        "dominates, and the α-β estimate is about three times the plain hook's.",
        "",
        "Iteration 2 sends a rank-1 factorisation (P and Q all_reduces) instead of the gradient; what it",
        "leaves out is kept per bucket in the state's error-feedback memory and added back next time:",
        "",
        "```\n" + "\n".join(memory) + "\n```",
        "",
        picture(nccl, "powersgd_nccl", "powerSGD_hook, 2 ranks, NCCL model: iterations 0-2"),
        "",
        "On **gloo** the same run never finishes. PowerSGD's callbacks call `.wait()` on a further all_reduce;",
        "a gloo callback runs on one of the group's 2 worker threads, so with two buckets in flight both",
        "workers are held by waiting callbacks, and the all_reduces they wait for are queued behind them:",
        "",
        excerpt(text_gloo, "3. What happened, in order (the trace, up to the failure)"),
        "",
        picture(gloo, "powersgd_gloo_deadlock", "powerSGD_hook, 2 ranks, gloo model: deadlock at iteration 2"),
        "",
        "The red bars on the worker lanes are the blocked waits; the all_reduce bars that never end are the",
        "queued collectives. Real DDP over real gloo hangs the same way (see README, Findings).",
        "",
    ]


def part_quantization() -> list[str]:
    out = ["## 3. The quantization hooks: gloo against NCCL", ""]
    for backend in ("nccl", "gloo"):
        story = record(quantization_hooks.quantization_pertensor_hook, world_size=2, backend=backend,
                       state="group", steps=1)
        text, _ = explain_story(story, label="quantization_pertensor_hook")
        out += [f"On the **{backend}** model (`--state group --steps 1 --backend {backend}`):", ""]
        out += [excerpt(text, "3. What happened", "5. What each future") if story.failed is None
                else excerpt(text, "4. The hook failed"), ""]
        out += [picture(story, f"quantization_pertensor_{backend}", f"quantization_pertensor_hook, {backend}"), ""]
    out += ["The hook all_gathers the quantized tensors and reads `fut.wait()[0]` as NCCL's one `(W, …)` tensor;",
            "gloo's all_gather future holds the *list* of per-rank tensors, so the same line indexes a list on gloo",
            "and the callback raises. The bytes section shows what quantization buys: uint8 on the wire, but an",
            "all_gather sends (W−1)·n per rank where a ring all_reduce sends 2(W−1)/W·n.", ""]
    return out


def part_range() -> list[str]:
    rows = ["| hook | world 8 | world 64 | world 1024 |", "|---|---|---|---|"]
    for name, hook in (("torch `fp16_compress_hook`", default_hooks.fp16_compress_hook),
                       ("1.8-era `hooks/legacy.py:fp16_compress_hook`", legacy.fp16_compress_hook)):
        api = "legacy" if hook is legacy.fp16_compress_hook else "current"
        cells = [f"{safe_range(hook, w, api=api).safe:.9g}" for w in (8, 64, 1024)]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    w3 = safe_range(default_hooks.fp16_compress_hook, 3)
    return [
        "## 4. A hook's safe input range",
        "",
        "`simcluster explain TARGET --range --world-sizes 8,64,1024` runs the real hook with every rank holding",
        "`+M` in every element and searches (×16 steps, then bisection on float32 bit patterns) for the largest",
        "`M` whose average is finite and within the fp16 tolerance. Largest safe `M`:",
        "",
        *rows,
        "",
        f"At world 3 torch's hook is safe only up to **{w3.safe:.9g}**, and that can be derived by hand. The hook",
        "computes `x = fp16(fp16(M) / 3)` and sums three `x` in fp16. fp16 rounds any sum ≥ 65520 to inf and",
        "3 · 21840 = 65520, so `x` must round to 21824 or below (fp16's spacing is 16 there): `fp16(M)/3 ≤ 21832`",
        "(the tie rounds to the even 21824), so `fp16(M) ≤ 65472` (spacing 32), so `M ≤ 65488` (the tie rounds",
        "to the even 65472). Powers of two divide exactly, which is why worlds 8, 64 and 1024 keep the whole",
        "fp16 range; the 1.8-era hook sums before dividing and loses a factor W.",
        "",
    ]


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    parts = ["# Tutorial: watching DDP communication hooks", "",
             "Generated by `python docs/make_tutorial.py` from real runs of torch's hooks in the simulator",
             "(seed 0); the pictures are in `docs/img/`. Every excerpt is `simcluster explain` output; the",
             "same pictures come from `--timeline PATH.svg`, and `--chrome-trace PATH.json` opens the run in",
             "Perfetto.", ""]
    parts += part_compression() + part_powersgd() + part_quantization() + part_range()
    (ROOT / "docs" / "tutorial.md").write_text("\n".join(parts), encoding="utf-8")
    print("wrote docs/tutorial.md and docs/img/*.svg")


if __name__ == "__main__":
    main()
