"""Shared fixtures: the bundled SmolLM2-135M-Instruct, loaded once per session."""

import pytest

from adaptive_llama.models import BUNDLED


@pytest.fixture(scope="session")
def smollm2_path():
    # Installed by the `test` extra: a missing model is a broken install, not a skip.
    return BUNDLED["smollm2"].path()


@pytest.fixture(scope="session")
def engine(smollm2_path):
    from adaptive_llama import Engine

    eng = Engine(smollm2_path, seed=1, n_ctx=1024)
    yield eng
    eng.close()
