"""The hook-state spec: parsed once (:meth:`StateSpec.parse`), resolved per rank (:meth:`StateSpec.resolve`).

Each kind — none, group, a callable factory, ``module:factory``, ``file.py:factory`` — is
parsed and resolved here, and a bad spec is shown to give a one-line message quoting it,
from the API and (exit 2) from the command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from simcluster import SimCluster
from simcluster.cli import main
from simcluster.ddp.model import SimDDP
from simcluster.errors import TargetLoadError, UsageError
from simcluster.fake.state import LayoutModel, StateSpec
from simcluster.hooks.reference import TopKState, mean_allreduce_hook
from simcluster.usercode.rank_local import RankLocal, rank_local_state
from simcluster.usercode.targets import load_state

GROUP = object()  # stands for a process group: resolve only hands it on


def one_arg_factory(process_group: Any) -> tuple[str, Any]:
    return ("made", process_group)


def model_factory(process_group: Any, model: torch.nn.Module) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in model.parameters()]


def keyword_model_factory(process_group: Any, *, model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _model() -> LayoutModel:
    return LayoutModel([torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))])


# --------------------------------------------------------------------------- the kinds
@pytest.mark.parametrize("spec", [None, "none"])
def test_none_resolves_to_no_state(spec: Any) -> None:
    parsed = StateSpec.parse(spec)
    assert (parsed.kind, parsed.name, parsed.factory) == ("none", "none", None)
    assert parsed.resolve(GROUP) is None


def test_group_resolves_to_the_ranks_group() -> None:
    parsed = StateSpec.parse("group")
    assert (parsed.kind, parsed.name) == ("group", "group")
    assert parsed.resolve(GROUP) is GROUP


def test_a_callable_factory_is_called_with_the_group_and_named_by_its_module() -> None:
    parsed = StateSpec.parse(one_arg_factory)
    assert parsed.kind == "factory" and parsed.factory is one_arg_factory
    assert parsed.name == "tests/test_state_spec.py:one_arg_factory"  # the spelling the CLI loads from here
    assert parsed.resolve(GROUP) == ("made", GROUP)
    assert StateSpec.parse(lambda pg: pg).name == "<factory>"  # a lambda has no loadable name


def test_the_model_is_built_only_for_factories_that_take_one() -> None:
    built: list[int] = []

    def build() -> LayoutModel:
        built.append(1)
        return _model()

    assert StateSpec.parse(one_arg_factory).resolve(GROUP, build) == ("made", GROUP) and built == []
    assert StateSpec.parse(model_factory).resolve(GROUP, build) == [(2, 3), (4,)] and built == [1]
    assert StateSpec.parse(keyword_model_factory).resolve(GROUP, _model()) == 10


def test_a_factory_that_needs_a_model_where_there_is_none_is_one_line() -> None:
    with pytest.raises(UsageError) as info:
        StateSpec.parse(model_factory).resolve(GROUP)
    assert "model_factory" in str(info.value) and "\n" not in str(info.value)


def test_parse_is_idempotent() -> None:
    parsed = StateSpec.parse(one_arg_factory)
    assert StateSpec.parse(parsed) is parsed


def test_module_factory_string_loads_once_by_the_clis_loader() -> None:
    parsed = load_state("simcluster.hooks.reference:TopKState")
    assert parsed.kind == "factory" and parsed.factory is TopKState
    assert parsed.name == "simcluster.hooks.reference:TopKState"
    assert isinstance(parsed.resolve(GROUP), TopKState)


def test_file_factory_string_loads_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "my_states.py"
    path.write_text("def make(pg):\n    return ('from file', pg)\n")
    parsed = load_state(f"{path}:make")
    assert parsed.name == f"{path}:make" and parsed.resolve(GROUP) == ("from file", GROUP)


def test_per_rank_loading_makes_a_rank_local_factory_named_by_its_spec() -> None:
    parsed = rank_local_state("simcluster.hooks.reference:TopKState")
    assert isinstance(parsed.factory, RankLocal) and parsed.factory.shared is TopKState
    given = RankLocal("simcluster.hooks.reference:TopKState")
    assert rank_local_state(given).name == "simcluster.hooks.reference:TopKState"


# --------------------------------------------------------------------------- resolved per rank, everywhere
def test_sim_cluster_and_sim_ddp_resolve_a_parsed_spec_per_rank() -> None:
    seen: list[int] = []

    def factory(pg: Any) -> Any:
        seen.append(pg.rank())
        return pg

    cluster = SimCluster(world_size=3, seed=0)
    run = cluster.run_hook(mean_allreduce_hook, [torch.ones(4)] * 3, StateSpec.parse(factory))
    assert [s.rank() for s in run.states] == [0, 1, 2] and sorted(seen) == [0, 1, 2]
    ddp = SimDDP(SimCluster(world_size=2, seed=0), mean_allreduce_hook, [(3,)], state="group")
    ddp.step([[torch.ones(3)], [torch.ones(3)]])
    assert [g.rank() for g in ddp.states] == [0, 1]


# --------------------------------------------------------------------------- bad specs: one line, quoting the value
@pytest.mark.parametrize("spec, error, quoted", [
    (5, UsageError, "state=5"),
    ("groups", TargetLoadError, "'groups'"),
    ("simcluster.hooks.reference:no_such_factory", TargetLoadError, "no_such_factory"),
    ("no_such_module_xyz:make", TargetLoadError, "no_such_module_xyz"),
    ("missing/file.py:make", TargetLoadError, "missing/file.py"),
    ("no colon", TargetLoadError, "'no colon'"),
])
def test_bad_specs_give_one_line_quoting_the_value(spec: Any, error: type[Exception], quoted: str) -> None:
    with pytest.raises(error) as info:
        load_state(spec)
    message = str(info.value)
    assert quoted in message and "\n" not in message


def test_without_a_loader_a_target_string_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError) as info:
        SimDDP(SimCluster(world_size=2, seed=0), mean_allreduce_hook, [(3,)], state="simcluster.hooks.reference:TopKState")
    assert "'simcluster.hooks.reference:TopKState'" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("argv", [
    ["check", "simcluster.hooks.reference:mean_allreduce_hook", "--state", "nowhere_xyz:make", "--quiet"],
    ["explain", "simcluster.hooks.reference:mean_allreduce_hook", "--state", "nowhere_xyz:make"],
])
def test_a_bad_state_at_the_cli_is_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("simcluster: error:") and "nowhere_xyz" in err and "\n" not in err


def test_module_examples_run() -> None:
    import doctest

    import simcluster.errors
    import simcluster.fake.state
    import simcluster.names

    for module in (simcluster.fake.state, simcluster.names, simcluster.errors):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
