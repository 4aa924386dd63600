"""The test suite's own arrangement: what keeps it within its time budget on 2 cores."""

import pytest


@pytest.fixture(scope="module")
def shared_run():
    return object()  # stands for a training run that several tests read


def test_tests_sharing_a_run_are_sent_to_one_worker(shared_run, request):
    """Under pytest-xdist's --dist loadgroup (setup.cfg), a test that reads a test module's shared fixture carries the
    group tests/conftest.py gave it in its id, which is what sends the group to one worker. With a pytest that
    pytest-xdist cannot rename tests under (9.2 with xdist 3.8), the groups split silently and every worker computes
    the shared runs again."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("the suite runs without pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@test_suite.shared_run"), request.node.nodeid
