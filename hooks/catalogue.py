"""The hook catalogue as plain data: what to run, how, and what must be found.

The checker and the tests iterate over :func:`entries`; ``docs/hooks.md`` renders the
same rows as a table.  Each :class:`CatalogueEntry` names a hook, how to build its state,
the accuracy it promises, which contract era it follows, and — for buggy hooks — the one
property that must catch it, plus the conditions under which the bug can show at all
(``needs``).  A property that fails on a reference entry is a bug in the harness or in
the reference; a buggy entry that passes its ``expected_failure`` property is a hole in
the harness.  That pair of counts is the harness's mutation score.

>>> len({e.name for e in entries()}) == len(entries())
True
>>> sorted({e.expected_failure for e in BUGGY}) == sorted(PROPERTIES)
True
"""

from collections.abc import Callable
from dataclasses import dataclass

from simcluster.limits import BACKEND_NAMES
from simcluster.hooks import buggy, legacy, reference

__all__ = [
    "CatalogueEntry",
    "PROPERTIES",
    "NEEDS",
    "REFERENCE",
    "BUGGY",
    "LEGACY",
    "entries",
    "by_name",
]

PROPERTIES = (
    "averages",
    "replicas_agree",
    "contract",
    "liveness",
    "keeps_nonfinite",
    "schedule_independence",
    "error_feedback",
)
"""The property names ``expected_failure`` may take."""

NEEDS = {
    "world>=3": "world size 3 or more (with 2 ranks the symptom cannot occur)",
    "buckets>=2": "two or more buckets in flight, i.e. a step after DDP's rebuild",
    "buckets>=3": "three or more buckets in flight",
    "rebuild": "two or more steps with a layout that rebuilds into several buckets",
    "subgroup": "DDP on a proper subgroup of a larger world (state 'group')",
    "large_values": "gradients near the value dtype's largest finite value (float16's under tolerance fp16), "
                    "same sign across ranks",
    "zero_rank": "one rank whose bucket is entirely zero",
    "nonfinite_rank": "one rank whose gradient holds an inf (or NaN) at one element, every other element finite",
    "distinct_rng": "ranks starting from different global RNG states",
    "repeated_grads": "gradients that repeat (or keep their sign) across steps",
    "registration": "the registration rules (DDP.register_comm_hook's signature checks)",
}
"""Vocabulary of :attr:`CatalogueEntry.needs`: the inputs a bug needs in order to show."""


@dataclass(frozen=True)
class CatalogueEntry:
    """One catalogued hook.

    * ``name`` — ``"<module>.<function>"`` inside :mod:`hooks`, e.g. ``"buggy.forgot_division"``.
    * ``hook`` — the hook function itself.
    * ``state`` — ``"none"`` (state ``None``: the hook uses ``dist.group.WORLD``),
      ``"group"`` (each rank's process group), or ``"module:factory"``, a callable called
      once per rank as ``factory(process_group)``.
    * ``tolerance`` — what *averages* may assume: ``"exact"``, ``"fp32"``, ``"fp16"``,
      ``"bf16"``, ``"none"`` (not an average per step: skip the averages property), or
      ``"rtol=…,atol=…"``.
    * ``api`` — ``"current"`` (>= 1.10 contract) or ``"legacy"`` (1.7 – 1.9, list results).
    * ``expected_failure`` — ``None`` for a correct hook; else the property (one of
      :data:`PROPERTIES`) that must catch it.  Other properties may fail as well.
    * ``backends`` — the backend models the entry is checked under; for a buggy entry the
      bug must be caught under *each* of them (a bug that only NCCL's all_gather value
      shape triggers lists ``("nccl",)``).
    * ``note`` — one line: the bug, for the README table.
    * ``needs`` — keys of :data:`NEEDS`: for a buggy entry, conditions without which the
      bug cannot show; for a correct one, conditions its check should cover.
    * ``min_world_size`` — the smallest world size at which it can show (or run).
    * ``bug_class`` — a few words naming the class of bug (``"overflow"``, ``"buckets in
      flight"``, …) for the mutation-score table; ``"legacy finding"`` marks a hook written
      as that era wrote it whose flaw the checker found (kept, not fixed).
    """

    name: str
    hook: Callable[..., object]
    state: str
    tolerance: str
    api: str = "current"
    expected_failure: str | None = None
    backends: tuple[str, ...] = BACKEND_NAMES
    note: str = ""
    needs: tuple[str, ...] = ()
    min_world_size: int = 1
    bug_class: str = ""

    def __post_init__(self) -> None:
        if self.expected_failure is not None and self.expected_failure not in PROPERTIES:
            raise ValueError(f"{self.name}: expected_failure={self.expected_failure!r} not in {PROPERTIES}")
        if self.api not in ("current", "legacy"):
            raise ValueError(f"{self.name}: api={self.api!r} must be 'current' or 'legacy'")
        unknown = [n for n in self.needs if n not in NEEDS]
        if unknown:
            raise ValueError(f"{self.name}: unknown needs {unknown}; known: {sorted(NEEDS)}")

    @property
    def is_buggy(self) -> bool:
        """True when a property is expected to fail."""
        return self.expected_failure is not None


def _ref(fn: Callable[..., object], state: str, tolerance: str, note: str, **kw: object) -> CatalogueEntry:
    return CatalogueEntry(f"reference.{fn.__name__}", fn, state, tolerance, note=note, **kw)  # type: ignore[arg-type]


def _bug(fn: Callable[..., object], prop: str, bug_class: str, state: str, tolerance: str, note: str,
         **kw: object) -> CatalogueEntry:
    return CatalogueEntry(
        f"buggy.{fn.__name__}", fn, state, tolerance, expected_failure=prop, note=note,  # type: ignore[arg-type]
        bug_class=bug_class, **kw,  # type: ignore[arg-type]
    )


REFERENCE: tuple[CatalogueEntry, ...] = (
    _ref(reference.mean_allreduce_hook, "none", "fp32", "divide, then all_reduce SUM"),
    CatalogueEntry("reference.mean_allreduce_hook[group]", reference.mean_allreduce_hook, "group", "fp32",
                   note="same, with each rank's process group as state (DDP on subgroups too)",
                   needs=("subgroup",)),
    _ref(reference.fp16_compress_hook, "none", "fp16", "divide in fp32, cast to fp16, all_reduce, copy back"),
    _ref(reference.bf16_compress_hook, "none", "bf16", "divide in fp32, cast to bf16, all_reduce, copy back"),
    _ref(reference.allgather_mean_hook, "none", "fp32", "all_gather, fold in rank order in fp64 (any backend)"),
    _ref(reference.scaled_fp16_hook, "none", "fp16", "MAX all_reduce waited in the hook body, scaled fp16 sum"),
    _ref(reference.topk_hook, "simcluster.hooks.reference:TopKState", "none",
         "top-k with per-parameter error feedback, rank-order merge", needs=("rebuild",)),
)

BUGGY: tuple[CatalogueEntry, ...] = (
    # averages
    _bug(buggy.forgot_division, "averages", "arithmetic", "none", "fp32", "sum, not mean", min_world_size=2),
    _bug(buggy.fp16_divide_after_allreduce, "averages", "overflow", "none", "fp16",
         "fp16 sum before the division overflows to inf", needs=("large_values",), min_world_size=2),
    _bug(buggy.fp16_no_division, "averages", "arithmetic + overflow", "none", "fp16", "fp16 sum, never divided", min_world_size=2),
    _bug(buggy.divides_by_global_world_size, "averages", "subgroups", "group", "fp32",
         "divides by the world's size, sums over a subgroup", needs=("subgroup",), min_world_size=4),
    _bug(buggy.inflight_shared_compressor, "averages", "buckets in flight", "simcluster.hooks.buggy:CompressorState", "fp16",
         "compressor keeps 'the' bucket in self: buckets in flight overwrite it",
         needs=("buckets>=2",), min_world_size=2),
    _bug(buggy.allgather_assumes_gloo_list, "averages", "backend portability", "none", "fp32",
         "NCCL's [flat] all_gather value read as gloo's list: rank 0's gradient for all",
         backends=("nccl",), min_world_size=2),
    # replicas_agree
    _bug(buggy.allgather_own_first, "replicas_agree", "replica divergence", "none", "fp32",
         "sums gathered rows starting from its own: rank-dependent rounding",
         needs=("world>=3",), min_world_size=3),
    _bug(buggy.dp_noise_per_rank_rng, "replicas_agree", "replica divergence", "none", "none",
         "noise added after all_reduce from each rank's own global RNG",
         needs=("distinct_rng",), min_world_size=2),
    _bug(buggy.fp16_copy_wrong_direction, "replicas_agree", "replica divergence", "none", "fp16",
         "reduced.copy_(buffer) instead of buffer.copy_(reduced): local gradient kept", min_world_size=2),
    # schedule_independence
    _bug(buggy.dp_noise_shared_generator, "schedule_independence", "schedule dependence", "simcluster.hooks.buggy:NoiseState", "none",
         "shared-seed noise drawn in callbacks, i.e. in completion order", needs=("buckets>=2",),
         backends=("gloo",)),  # NCCL completes a group's collectives in issue order: no reordering to see
    # contract
    _bug(buggy.returns_offset_view, "contract", "copy-back", "none", "fp32",
         "returns packed[1:]: DDP reads storage from element 0, gradients shift by one"),
    _bug(buggy.returns_strided_view, "contract", "copy-back", "none", "fp32",
         "returns a stride-2 column of stack(dim=1): DDP reads interleaved data"),
    _bug(buggy.fire_and_forget_allreduce, "contract", "collective not waited for", "none", "fp32",
         "returns a future it completed itself: DDP copies the bucket before the all_reduce writes",
         min_world_size=2),
    _bug(buggy.returns_list, "contract", "result type", "none", "fp32", "resolves to [tensor] (pre-1.10 style)"),
    _bug(buggy.returns_future_value, "contract", "result type", "none", "fp32", "returns the collective's future: value [tensor]"),
    _bug(buggy.returns_tensor_not_future, "contract", "result type", "none", "fp32", "returns a Tensor, not a Future"),
    _bug(buggy.misnamed_bucket_param, "contract", "registration", "none", "fp32",
         "second parameter not named 'bucket': KeyError at registration", needs=("registration",)),
    _bug(buggy.string_annotations, "contract", "registration", "none", "fp32",
         "string annotations: ValueError at registration", needs=("registration",)),
    _bug(buggy.allgather_assumes_nccl_flat, "contract", "backend portability", "none", "fp32",
         "gloo's list all_gather value read as NCCL's [flat]: 0-d result", backends=("gloo",)),
    # liveness
    _bug(buggy.rank0_logs_global_norm, "liveness", "rank-dependent collective", "none", "fp32",
         "collective for a log line issued on rank 0 only", min_world_size=2),
    _bug(buggy.skip_allreduce_if_zero, "liveness", "data-dependent collective", "none", "fp32",
         "skips the all_reduce when the local bucket is zero", needs=("zero_rank",), min_world_size=2),
    _bug(buggy.scaled_fp16_blocking, "liveness", "blocking callback", "none", "fp16",
         ".wait() on a 2nd collective inside .then: starves gloo's 2 workers",
         backends=("gloo",), needs=("buckets>=2",)),
    _bug(buggy.clip_waits_for_last_bucket, "liveness", "wait on later work", "simcluster.hooks.buggy:ClipState", "none",
         "callbacks wait for a future only the last bucket completes", needs=("buckets>=3",),
         backends=("gloo",)),  # the NCCL model runs callbacks at completion, not inline at issue: see docs/hooks.md
    _bug(buggy.skips_on_local_overflow, "liveness", "data-dependent collective", "none", "fp32",
         "skips the all_reduce when the local bucket holds an inf/NaN", needs=("nonfinite_rank",), min_world_size=2),
    # keeps_nonfinite
    _bug(buggy.hides_overflow, "keeps_nonfinite", "hidden overflow", "none", "fp32",
         "nan_to_num_ before the all_reduce: GradScaler never sees the overflow", needs=("nonfinite_rank",)),
    # error_feedback
    _bug(buggy.topk_residual_keyed_by_index, "error_feedback", "state vs rebuild", "simcluster.hooks.buggy:IndexedResidualState", "none",
         "error memory keyed by bucket.index(): wrong size after the rebuild", needs=("rebuild",)),
    _bug(buggy.topk_forgets_inplace_add, "error_feedback", "error feedback", "simcluster.hooks.buggy:IndexedResidualState", "none",
         "buffer.add(residual) (not add_): error feedback silently off", needs=("repeated_grads",)),
)

LEGACY: tuple[CatalogueEntry, ...] = (
    CatalogueEntry("legacy.allreduce_hook", legacy.allreduce_hook, "none", "fp32", api="legacy",
                   expected_failure="averages", needs=("large_values",), min_world_size=2,
                   bug_class="legacy finding",
                   note="1.7/1.8: get_tensors()[0], divide in the callback after the sum: inf near float32's max"),
    CatalogueEntry("legacy.fp16_compress_hook", legacy.fp16_compress_hook, "none", "fp16", api="legacy",
                   expected_failure="averages", needs=("large_values",), min_world_size=2,
                   bug_class="legacy finding",
                   note="1.8: cast, fp16 all_reduce, divide while copying back: the fp16 sum overflows"),
    CatalogueEntry("legacy.stats_mean_hook", legacy.stats_mean_hook, "simcluster.hooks.legacy:LegacyStatsState", "fp32",
                   api="legacy", note="1.9: every accessor of the old GradBucket"),
    CatalogueEntry("legacy.fp16_wrapped_allreduce_hook", legacy.fp16_wrapped_allreduce_hook, "none", "fp16",
                   api="legacy", expected_failure="averages", needs=("large_values",), min_world_size=2,
                   bug_class="overflow", note="fp16 wrapper (set_tensor) around a divide-after-sum hook: inf"),
    CatalogueEntry("legacy.allreduce_sum_hook", legacy.allreduce_sum_hook, "none", "fp32", api="legacy",
                   expected_failure="averages", min_world_size=2, bug_class="arithmetic",
                   note="1.7-era sum hook, no division"),
)


def entries() -> tuple[CatalogueEntry, ...]:
    """Every entry: reference, then buggy, then legacy (a stable order)."""
    return REFERENCE + BUGGY + LEGACY


def by_name(name: str) -> CatalogueEntry:
    """The entry called ``name`` (e.g. ``"buggy.forgot_division"``); ``KeyError`` listing the names if absent."""
    for entry in entries():
        if entry.name == name:
            return entry
    raise KeyError(f"no catalogue entry {name!r}; known: {[e.name for e in entries()]}")
