import os

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
