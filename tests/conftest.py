import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).parents[1] / "bench"))  # benchlib: what the bench scripts share


def pytest_collection_modifyitems(config, items):
    """`slow` tests (the real bundled target, multi-process and subprocess runs: pyproject's markers) run unless
    DRAFTSMITH_SKIP_SLOW=1."""
    import os

    if os.environ.get("DRAFTSMITH_SKIP_SLOW") == "1":
        skip = pytest.mark.skip(reason="DRAFTSMITH_SKIP_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def kernel_choices_apart(tmp_path_factory):
    """The kernel choices eval measures for tiny targets go to a file of the session's, not the user's cache."""
    from draftsmith.decode import kernel_choice

    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("kernels") / kernel_choice.CACHE_NAME
        patch.setattr(kernel_choice, "cache_path", lambda: path)
        yield path


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models run fastest on one thread (a second one only waits); real-model tests raise it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
