import os
import zlib
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(autouse=True)
def _no_leaked_buffer_hooks():
    """Removes the global buffer-registration hooks a test leaves behind.

    torch 2.11's non-strict `torch.export` installs one (`register_buffer_assignment_hook`)
    and does not remove it when the export fails, as the tests of tfun errors under export
    make it. Every later `register_buffer` in the process then runs it, which Dynamo cannot
    trace: a test of a body that registers a buffer got a different error under `tfun.jit`,
    depending on what ran before it. torch 2.13 removes the hook.
    """
    hooks = getattr(torch.nn.modules.module, "_global_buffer_registration_hooks", None)
    before = set(hooks) if hooks is not None else set()
    yield
    if hooks is not None:
        for key in set(hooks) - before:
            del hooks[key]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks all but one cell of each parametrized test `thinned_cell`.

    CI's second torch phase (2.14.1) runs `-m "not heavy and not thinned_cell"`: every test
    function of every module, each parametrized one with one of its cells. Which cell is fixed
    by the test's name (a CRC of its node id), so that across the suite each value of a two-
    or three-way parameter (aot_eager/inductor, forward/reverse) is kept somewhere, and the
    selection is the same on every machine and xdist worker. Cells already marked `heavy` are
    not counted. The first phase (torch 2.13, the README's command) runs every cell.
    """
    cells: defaultdict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        if getattr(item, "callspec", None) is not None and item.get_closest_marker("heavy") is None:
            cells[item.nodeid.partition("[")[0]].append(item)
    for test, group in cells.items():
        if len(group) < 2:
            continue  # its one cell left in that phase stays
        crc = zlib.crc32(test.encode())
        kept = crc % len(group)
        for i, item in enumerate(group):
            if i != kept:
                item.add_marker(pytest.mark.thinned_cell)
