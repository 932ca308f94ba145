"""Each simulated rank's view of torch's process-wide state, swapped in and out.

A real rank is a process: ``dist.group.WORLD``, ``dist.get_rank()``, the default
CPU generator behind ``torch.rand``/``torch.manual_seed`` are its own. Simulated
ranks share one process, and — because one OS thread runs code of many ranks in turn
— "which rank am I" is the engine's current rank, not the thread. So whenever the
code about to run belongs to another rank, :class:`RankContexts` swaps:

* ``torch.distributed.distributed_c10d._world`` — torch's registry of groups — for
  that rank's own :class:`RankWorld` (default group = the rank's simulated WORLD);
* the default CPU generator's state (saved for the rank leaving, loaded for the rank
  entering), so ``torch.manual_seed`` inside PowerSGD on rank 0 never moves rank 1's
  random stream;
* which rank :data:`simcluster.usercode.rank_state.CURRENT` names, so Python's ``random`` and
  numpy's global generator draw from the entering rank's own generators and a
  :class:`~simcluster.usercode.rank_local.RankLocal` hook calls that rank's copy of its module;
* and, for the rank leaving, a check that it changed no process-wide setting
  (:class:`~simcluster.usercode.rank_state.SettingsAudit`);
* with ``launcher="torchrun"`` only, torchrun's per-rank variables in ``os.environ``
  (``RANK``, ``LOCAL_RANK``, ``ROLE_RANK``: :class:`~simcluster.fake.launcher.LauncherEnvironment`);
  with the default ``launcher="none"`` the switch pays one attribute test for it.

:func:`install_torch_patches` installs, for the duration of a run only, simulated versions
of the torch functions whose real versions would escape the simulation
(``dist.new_group`` — real group creation needs a store and a barrier;
``torch.futures.collect_all``/``wait_all`` — they return plain C++ futures whose
``wait`` would block the run's only thread); :func:`restore_torch_patches` puts
everything back, so after a run torch's global distributed state is exactly as before.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from simcluster.engine.contract import EngineContract
from simcluster.engine.frames import is_internal, posting_site, short_path
from simcluster.engine.matching import MAX_LISTED
from simcluster.fake.launcher import LauncherEnvironment, check_launcher
from simcluster.fake import futures
from simcluster.errors import CollectiveMismatchError, UsageError
from simcluster.fake.process_group import CoalescedWork, GroupSpec, Runtime, SimProcessGroup
from simcluster.names import wear_torchs_name
from simcluster.usercode.rank_state import (CURRENT, ModulePatch, RankGenerators, SettingsAudit, apply_module_patches,
                                            install_generators, install_process_ids, rank_seed, restore_generators,
                                            restore_process_ids, undo_module_patches)

__all__ = ["RankWorld", "RankContexts", "install_torch_patches", "restore_torch_patches", "nccl_version_stand_in",
           "NCCL_VERSION_STAND_IN"]

_GENERATOR = torch.default_generator
"""What ``torch.get_rng_state``/``set_rng_state`` read and write (called directly: a rank switch is hot)."""


def check_new_group_ranks(rank: int, ranks: list[int], world_size: int) -> None:
    """Refuse a bad ``dist.new_group`` rank list (``ranks`` sorted, as torch sorts them) with
    the exception real torch 2.13 raises, first line byte for byte, so e2e compares like with
    like (measured: ``benchmarks/measure_new_group_errors.py``, docs/gloo-facts.md): a
    duplicate, more ranks than the world, a rank out of range -- ``ValueError``; an empty
    list -- torch gets as far as constructing the group and fails there with a pybind
    ``TypeError``. The simulator raised one ValueError of its own for all four until
    2026-12-03 (wild5: a hook's factory splitting a one-rank world in halves)."""
    where = f"simcluster: dist.new_group(ranks={ranks!r}) on rank {rank} of a world of {world_size}"
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks list must not contain duplicate entries, got {ranks}")
    if len(ranks) > world_size:
        raise ValueError("the new group's world size should be less or equal to the world size set by "
                         "init_process_group")
    for r in ranks:
        if r < 0 or r >= world_size:
            raise ValueError(f"Rank {r} is out of range. Valid ranks are 0 to {world_size - 1} (world_size={world_size})")
    if not ranks:
        raise TypeError("__init__(): incompatible constructor arguments. The following argument types are "
                        f"supported:\n{where}: an empty rank list; torch 2.13 fails constructing the group's "
                        "ProcessGroup with this pybind error (measured)")

class RankWorld(c10d._World):
    """One rank's private ``_World``: torch's group registry, per instance.

    torch's ``_World`` keeps its maps in module globals shared by every instance; this
    subclass keeps them on the instance, so each simulated rank sees only its groups.
    """

    def __init__(self) -> None:
        super().__init__()
        self._maps: dict[str, dict[Any, Any]] = {
            name: {} for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "tags_to_pg", "pg_to_tag")
        }
        self._count = 1  # torch names groups by this count; WORLD, made first, is "0"

    pg_map = property(lambda self: self._maps["pg_map"])  # type: ignore[assignment]
    pg_names = property(lambda self: self._maps["pg_names"])  # type: ignore[assignment]
    pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])  # type: ignore[assignment]
    pg_backend_config = property(lambda self: self._maps["pg_backend_config"])  # type: ignore[assignment]
    tags_to_pg = property(lambda self: self._maps["tags_to_pg"])  # type: ignore[assignment]
    pg_to_tag = property(lambda self: self._maps["pg_to_tag"])  # type: ignore[assignment]

    @property  # type: ignore[override]
    def group_count(self) -> int:
        return self._count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._count = value

    def register(self, pg: SimProcessGroup, *, default: bool = False) -> None:
        """Make ``pg`` known to torch's front end on this rank (as ``init_process_group`` would)."""
        spec = pg.spec
        # dist.get_backend() reads this: the modelled backend's own name, "gloo" or "nccl",
        # as a hook branching on it sees on a real cluster (whatever getBackendName() says:
        # real DDP's groups answer "simcluster-gloo" there). torch's error logger calls
        # torch.cuda.nccl.version() for an "nccl" group, which a CPU build lacks: a run under
        # the NCCL model puts a stand-in there (install_torch_patches).
        self.pg_map[pg] = (pg.model_backend, None)
        self.pg_names[pg] = spec.name
        self.pg_group_ranks[pg] = {g: i for i, g in enumerate(spec.ranks)}
        self.pg_backend_config[pg] = pg.getBackendName()
        tag = f"ptd:{spec.name}"
        self.tags_to_pg.setdefault(tag, []).append(pg)
        self.tags_to_pg.setdefault("", []).append(pg)
        self.pg_to_tag[pg] = tag
        if default:
            self.default_pg = pg
            pg._set_group_desc("default_pg")  # what init_process_group names it (measured, torch 2.13)


def new_group_options(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, bool, str]:
    """``(use_local_synchronization, sort_ranks, group_desc)`` of a call ``dist.new_group(ranks,
    *args, **kwargs)`` — torch 2.13's parameters after ``ranks``: ``timeout, backend, pg_options,
    use_local_synchronization, group_desc, device_id, sort_ranks`` (the others change nothing
    the simulator models). A group made without ``group_desc`` is described ``"undefined"``, as
    torch describes it (measured, torch 2.13 with gloo; WORLD: ``"default_pg"``)."""
    local = kwargs.get("use_local_synchronization", args[3] if len(args) > 3 else False)
    desc = kwargs.get("group_desc", args[4] if len(args) > 4 else None)
    sort = kwargs.get("sort_ranks", args[6] if len(args) > 6 else True)
    return bool(local), bool(sort), "undefined" if desc is None else str(desc)


class _Made:
    """A group some members made and the rest may still make: done once all of them did —
    what a member that made it waits on when the backend connects members at creation
    (:attr:`~simcluster.fake.backends.BackendModel.new_group_waits`; a
    :class:`~simcluster.engine.contract.Waitable`)."""

    __slots__ = ("spec", "name", "joined", "sites", "_resumers", "_lock")

    def __init__(self, spec: GroupSpec, name: str, lock: threading.Lock) -> None:
        self.spec, self.name = spec, name
        self.joined: list[int] = []
        self.sites: dict[int, str | None] = {}  # rank -> the user line that made it (for a report)
        self._resumers: list[Callable[[], None]] = []
        self._lock = lock  # the registry's: real DDP's rank threads join and wait at once

    @property
    def label(self) -> str:
        made = f" (torch's group {self.name!r})" if self.name else " (use_local_synchronization)"
        return (f"dist.new_group({list(self.spec.ranks)}){made}, which gloo returns from once every member made "
                "the group")

    def done(self) -> bool:
        return len(self.joined) == len(self.spec.ranks)

    def on_done(self, resume: Callable[[], None]) -> None:
        with self._lock:  # else a member joining between the test and the append would never wake this one
            if not self.done():
                self._resumers.append(resume)
                return
        resume()

    def join(self, rank: int) -> list[Callable[[], None]]:
        """``rank`` made it (under the lock); the waiters to resume, after the lock, if that completes it."""
        self.joined.append(rank)
        if not self.done():
            return []
        resumers, self._resumers = self._resumers, []
        return resumers


class GroupRegistry:
    """The groups ``dist.new_group`` made on one set of simulated ranks, named as torch 2.13
    names them (measured: ``benchmarks/measure_new_group_names.py``, docs/gloo-facts.md §7):

    * a group is named by how many groups the rank's process made before it —
      ``str(_world.group_count)``, counted on every ``new_group`` call, a member's or not
      (WORLD is ``"0"``) — and its members meet under that name. Every rank must call
      ``new_group`` for every group, in one order, members or not. Two groups made under
      one name with different ranks — each rank making only the groups it is in, so rank 0's
      and rank 2's first groups are both ``"1"`` — are a :class:`CollectiveMismatchError`
      that ends the run: on real gloo their ranks connect across the two groups (measured:
      connection resets, timeouts, sometimes sums that look right) — unless both have one
      rank: such a group connects to no one, and two of them under one name both work
      (measured);
    * with ``use_local_synchronization=True`` a group is named by its ranks (here: the k-th
      such call with the same ranks), only its members call it, and a non-member's call
      returns None;
    * under gloo (:attr:`~simcluster.fake.backends.BackendModel.new_group_waits`) a member
      returns only once every member made the group: a member left alone is parked there
      and, if the others never make it, the run is a deadlock (real gloo: it waits until
      its timeout).

    Shared by the baton-engine cluster (:class:`RankContexts`) and real DDP on threads
    (:mod:`simcluster.ddp.real_ddp`)."""

    def __init__(self, runtime: Runtime, worlds: list[RankWorld]) -> None:
        self.runtime = runtime
        self.worlds = worlds
        self._named: dict[str, _Made] = {}  # torch's name (and the rank, for a one-rank group) -> the group
        self._local: dict[tuple[tuple[int, ...], int], _Made] = {}  # use_local_synchronization
        self._calls: dict[tuple[int, tuple[int, ...]], int] = {}
        self._lock = threading.Lock()  # real DDP's rank threads make groups at once

    def new_group(self, engine: EngineContract, rank: int, ranks: list[int] | None,
                  args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> SimProcessGroup | object:
        """``dist.new_group(ranks, *args, **kwargs)`` called by ``rank``'s code under ``engine``:
        its simulated group, ``GroupMember.NON_GROUP_MEMBER`` for a non-member as in torch
        (None with ``use_local_synchronization``); may wait, or end the run (see the class)."""
        local, sort, desc = new_group_options(args, kwargs or {})
        world_size = len(self.worlds)
        members = tuple(range(world_size)) if ranks is None else tuple(sorted(ranks) if sort else ranks)
        if local and rank not in members:
            return None  # torch returns before it checks the ranks
        check_new_group_ranks(rank, list(members), world_size)
        world = self.worlds[rank]
        if local:
            name = ""
        else:
            name = str(world.group_count)
            world.group_count += 1
        if rank not in members:
            # torch registers the non-member's NON_GROUP_MEMBER with this group's rank map
            # (each such call overwrites it), so a root given as a global rank of this
            # group translates before the collective's not-in-group check skips it.
            world.pg_group_ranks[dist.GroupMember.NON_GROUP_MEMBER] = {g: i for i, g in enumerate(members)}
            return dist.GroupMember.NON_GROUP_MEMBER
        site = posting_site(sys._getframe(1))  # the user line of this call, for a collision's report
        with self._lock:
            if local:
                k = self._calls.get((rank, members), 0)
                self._calls[(rank, members)] = k + 1
                made = self._local.get((members, k))
                if made is None:
                    spec = GroupSpec(f"group{list(members)}" + (f"#{k + 1}" if k else "") + " (local)", members)
                    made = self._local[(members, k)] = _Made(spec, "", self._lock)
            else:
                key = name
                made = self._named.get(key)
                if made is not None and made.spec.ranks != members and len(members) == len(made.spec.ranks) == 1:
                    key = f"{name} {members[0]}"  # one-rank groups connect to no one: kept apart
                    made = self._named.get(key)
                if made is None:
                    spec = GroupSpec(f"group{name}{list(members)}", members)
                    made = self._named[key] = _Made(spec, name, self._lock)
                elif made.spec.ranks != members:
                    engine.abort(CollectiveMismatchError(_crossed_groups(rank, members, made, site)))
            resume = made.join(rank)
            made.sites[rank] = site
        for wake in resume:
            wake()
        pg = SimProcessGroup(self.runtime, made.spec, rank)
        pg._set_group_desc(desc)
        world.register(pg)
        if not made.done() and self.runtime.backend.new_group_waits:
            engine.block_until(made)
        return pg


def _crossed_groups(rank: int, members: tuple[int, ...], made: _Made, site: str | None) -> str:
    """Why rank ``rank``'s group of ``members`` (made at the user line ``site``) and the group
    ``made`` under the same name cannot both be, with where each was made."""
    who = f"rank {made.joined[0]}" if len(made.joined) == 1 else f"ranks {made.joined}"
    makers = [(rank, members, site), *((r, made.spec.ranks, made.sites[r]) for r in made.joined)]
    lines = [f"\n  rank {r} made {list(ranks)} at {at}" for r, ranks, at in makers if at]
    return (
        f"dist.new_group: rank {rank} made the group {list(members)} as its group {made.name!r}, but {who} made "
        f"{list(made.spec.ranks)} under that name. torch names a group by how many new_group calls its process "
        "made before it (str(_world.group_count), a member's call or not), and a group's members meet under its "
        f"name: on a real cluster these two groups share the name {made.name!r} and their ranks connect across "
        "them (measured on gloo: connection resets, timeouts, or sums that look right; docs/gloo-facts.md §7). "
        "Every rank must call new_group for every group, in the same order, members or not — or pass "
        "use_local_synchronization=True, which names a group by its ranks and is called by its members only."
        + "".join(lines[:MAX_LISTED])
    )


class RankContexts:
    """Every rank's world, groups and RNG state for one cluster, plus the swap logic.

    ``rng="per_rank"`` starts rank ``r`` from ``torch.manual_seed(seed + r)`` — like a
    script seeding with its rank; ``rng="same"`` starts every rank from ``seed``; Python's
    ``random`` and numpy's global generator likewise (:class:`RankGenerators`).
    Groups and each rank's module copies (``modules[r]``) live here across runs (a group
    made by ``new_group`` in one step is used in the next, as in a training loop).
    """

    def __init__(self, world_size: int, runtime: Runtime, *, seed: int, rng: str,
                 launcher: str | LauncherEnvironment = "none") -> None:
        if rng not in ("per_rank", "same"):
            raise UsageError(f"rng={rng!r} must be 'per_rank' or 'same'")
        if isinstance(launcher, LauncherEnvironment):  # each rank's variables given (simcluster e2e under torchrun)
            if launcher.world_size != world_size:
                raise UsageError(f"a launcher environment for {launcher.world_size} ranks, but the cluster has {world_size}")
            self.launcher: LauncherEnvironment | None = launcher
        else:
            self.launcher = LauncherEnvironment(world_size) if check_launcher(launcher) == "torchrun" else None
        """torchrun's variables per rank (``launcher="torchrun"``), or None: ``os.environ`` untouched."""
        self.world_size = world_size
        self.runtime = runtime
        self.worlds = [RankWorld() for _ in range(world_size)]
        world_spec = GroupSpec("WORLD", tuple(range(world_size)))
        self.world_groups = [SimProcessGroup(runtime, world_spec, r) for r in range(world_size)]
        for r in range(world_size):
            self.worlds[r].register(self.world_groups[r], default=True)
        generator = torch.Generator()
        self.rng_states = [
            generator.manual_seed(rank_seed(seed, r, rng)).get_state() for r in range(world_size)
        ]
        self.groups = GroupRegistry(runtime, self.worlds)
        self._outside_rng: torch.Tensor | None = None
        self._outside_world: Any = None
        self.generators = RankGenerators(world_size, seed, rng)
        self.modules: list[dict[str, Any]] = [{} for _ in range(world_size)]
        self.patches: list[list[ModulePatch]] = [[] for _ in range(world_size)]
        """Each rank's own values of torch's module attributes, in place while its code runs
        (what its module copies' imports replaced: :func:`~simcluster.usercode.rank_state.imports_set_the_baseline`)."""
        self.audit = SettingsAudit()
        self._futures_made = [itertools.count() for _ in range(world_size + 1)]  # the last: outside every rank
        self.future_class: tuple[type, list[Any]] | None = None
        """This cluster's ``torch.futures.Future`` stand-in and the one-slot holder naming the
        run's engine (see :func:`user_future_class`; made on the first run)."""
        self.new_group_patch: tuple[Callable[..., Any], list[Any]] | None = None
        """This cluster's simulated ``dist.new_group`` and its holder of the run's engine (first run)."""

    # -- swapping ---------------------------------------------------------------
    def switch(self, old: int | None, new: int | None) -> None:
        """Leave rank ``old`` (None: outside the run) and enter rank ``new``."""
        if old is None:
            self._outside_rng = _GENERATOR.get_state()
            self._outside_world = c10d._world
            if self.launcher is not None and new is not None:
                self.launcher.begin()
            self.audit.start()
            CURRENT.generators = self.generators
        else:
            self.rng_states[old] = _GENERATOR.get_state()
            if self.patches[old]:
                undo_module_patches(self.patches[old])
            self.audit.check(old, new)
        if new is None:
            self.audit.finish()
            if self.launcher is not None:
                self.launcher.end()
            _GENERATOR.set_state(self._outside_rng)
            c10d._world = self._outside_world
            CURRENT.generators = CURRENT.modules = CURRENT.patches = None
        else:
            _GENERATOR.set_state(self.rng_states[new])
            c10d._world = self.worlds[new]
            CURRENT.modules = self.modules[new]
            patches = CURRENT.patches = self.patches[new]
            if patches:
                apply_module_patches(patches)
            if self.launcher is not None:
                self.launcher.enter(new, self.audit.environ_baseline)
                self.audit.environ_synced()
            if CURRENT.announce is not None:
                CURRENT.announce(new)
        CURRENT.rank = new

    def future_number(self, rank: int | None) -> int:
        """The number of the next ``torch.futures.Future()`` made by ``rank``'s code (None:
        code outside every rank): per rank, from 0, in the order the rank made them over
        the cluster's life — a rank is a process, and its futures are numbered as that
        process made them, never by ``id()``. (``next`` of an ``itertools.count`` is one C
        call: two threads of one rank under the free-running engine never get the same.)"""
        return next(self._futures_made[self.world_size if rank is None else rank])


def user_future_class(current_engine: Callable[[], Any], plain: type, number: Callable[[int | None], int]) -> type:
    """The class ``torch.futures.Future`` names during a run: a future made by hook code
    (``torch.futures.Future()``) becomes a :class:`~simcluster.fake.futures.SimFuture` of the
    running rank, so waiting on it while it is pending parks that rank instead of
    blocking the run's only thread in C++ — a hang becomes a reported deadlock.
    ``current_engine()`` is the run in progress (the class is made once per cluster:
    making a subclass of torch's C++ future costs ~0.3 ms, a whole tiny step).

    Each is named in traces and reports by its rank's count, ``number(rank)``, and the
    user line that made it: ``torch.futures.Future() #1 made by rank 1 at hooks.py:12``."""

    class Future(futures.SimFuture, plain):  # type: ignore[valid-type,misc] - a torch.futures.Future, as torch's
        def __init__(self, *, devices: Any = None) -> None:
            if devices:  # refused as torch refuses them (a CPU device: "Expected devices to have indices, got cpu")
                torch._C.Future([torch.device(d) for d in devices])
            engine = current_engine()
            rank = engine.current_rank
            who = "code outside every rank" if rank is None else f"rank {rank}"
            label = f"torch.futures.Future() #{number(rank)} made by {who}{_made_at(sys._getframe(1))}"
            super().__init__(engine, -1 if rank is None else rank, label)

        def set_exception(self, result: BaseException) -> None:
            # as torch.futures.Future's (measured on 2.13): refused unless an Exception, then
            # the value that wait() and value() raise
            if not isinstance(result, Exception):
                raise AssertionError(f"{result} is of type {type(result)}, not an Exception.")
            self._set_exception(result)

        def __class_getitem__(cls, item: Any) -> Any:  # Future[torch.Tensor] in annotations
            return plain[item]

    wear_torchs_name(Future, plain)
    for name, method in vars(Future).items():  # Python's own errors name them: "Future.__init__() takes …"
        if inspect.isfunction(method):
            method.__qualname__ = f"Future.{name}"
    return Future


def _made_at(frame: FrameType | None) -> str:
    """`` at file:line`` of the innermost user frame from ``frame`` outward ("" if none)."""
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return "" if frame is None else f" at {short_path(frame.f_code.co_filename)}:{frame.f_lineno}"


def _future_class_for(contexts: RankContexts, engine: Any) -> type:
    """``contexts``' ``Future`` class (made on its first run), now naming ``engine``."""
    found = contexts.future_class
    if found is None:
        holder: list[Any] = [None]
        found = contexts.future_class = (user_future_class(lambda: holder[0], torch.futures.Future,
                                                           contexts.future_number), holder)
    found[1][0] = engine
    return found[0]


Patches = tuple[tuple[Any, ...], Any]
"""What :func:`install_torch_patches` replaced: the six originals (``c10d.new_group``,
``dist.new_group``, ``collect_all``, ``wait_all``, ``Future``, ``torch.cuda.nccl.version``)
and the generators' and process ids' originals."""


def _new_group_for(contexts: RankContexts) -> tuple[Callable[..., Any], list[Any]]:
    """``contexts``' simulated ``dist.new_group`` (made once per cluster) and the one-slot
    holder of the run's engine it asks (set by each install)."""
    found = contexts.new_group_patch
    if found is None:
        holder: list[Any] = [None]

        def new_group(ranks: list[int] | None = None, *args: Any, **kwargs: Any) -> Any:
            engine = holder[0]
            rank = engine.current_rank
            if rank is None:
                raise UsageError("dist.new_group was called outside a simulated rank while a run is in progress")
            return contexts.groups.new_group(engine, rank, None if ranks is None else list(ranks), args, kwargs)

        found = contexts.new_group_patch = (new_group, holder)
    return found


def install_torch_patches(contexts: RankContexts, engine: Any) -> Patches:
    """Install, for the run of ``engine``, the simulated ``new_group``, ``collect_all``,
    ``wait_all`` and ``torch.futures.Future``, and the per-rank ``random`` and
    ``numpy.random`` dispatchers (:func:`~simcluster.usercode.rank_state.install_generators`) and
    each rank's process id (:func:`~simcluster.usercode.rank_state.install_process_ids`);
    :func:`restore_torch_patches` puts back what this returns (five attribute stores each
    way, the replacements made once per cluster: a run's set-up is hot)."""
    new_group, holder = _new_group_for(contexts)
    holder[0] = engine
    futures_module = torch.futures
    saved = (c10d.new_group, dist.new_group, futures_module.collect_all, futures_module.wait_all,
             futures_module.Future, torch.cuda.nccl.version, c10d.batch_isend_irecv, dist.batch_isend_irecv)
    try:
        c10d.new_group = dist.new_group = new_group
        futures_module.collect_all, futures_module.wait_all = futures.collect_all, futures.wait_all
        futures_module.Future = _future_class_for(contexts, engine)
        if contexts.runtime.backend.knows_nccl_version:
            torch.cuda.nccl.version = nccl_version_stand_in
        if contexts.runtime.backend.coalesces_p2p:
            c10d.batch_isend_irecv = dist.batch_isend_irecv = coalesced_batch_isend_irecv
        pids = install_process_ids()
        try:
            return saved, (install_generators(), pids)
        except BaseException:
            restore_process_ids(pids)
            raise
    except BaseException:
        _restore(saved)
        raise


def restore_torch_patches(patches: Patches) -> None:
    """Put back everything :func:`install_torch_patches` replaced."""
    saved, (generators, pids) = patches
    try:
        restore_generators(generators)
    finally:
        restore_process_ids(pids)
        _restore(saved)


def _restore(saved: tuple[Any, ...]) -> None:
    futures_module = torch.futures
    (c10d.new_group, dist.new_group, futures_module.collect_all, futures_module.wait_all,
     futures_module.Future, torch.cuda.nccl.version, c10d.batch_isend_irecv, dist.batch_isend_irecv) = saved


_TORCH_BATCH_ISEND_IRECV = c10d.batch_isend_irecv


def coalesced_batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
    """``dist.batch_isend_irecv`` under a model whose backend coalesces a batch (NCCL,
    :attr:`~simcluster.fake.backends.BackendModel.coalesces_p2p`): torch's own function
    checks the list and posts each op (a simulated group takes its per-op path), and the
    works come back as one, as ``cm.works`` holds one on a real NCCL group."""
    works = _TORCH_BATCH_ISEND_IRECV(p2p_op_list)
    return [CoalescedWork(works)] if works else []


NCCL_VERSION_STAND_IN = (2, 27, 3)
"""What ``torch.cuda.nccl.version()`` answers during a run under the NCCL model: a real NCCL
cluster has a CUDA build that knows its NCCL; this CPU build does not. Only torch's
collective error logger reads it (for a log field), so its value changes nothing checked."""


def nccl_version_stand_in() -> tuple[int, int, int]:
    """:data:`NCCL_VERSION_STAND_IN` (``torch.cuda.nccl.version``'s stand-in during an NCCL-model run)."""
    return NCCL_VERSION_STAND_IN
