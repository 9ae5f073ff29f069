"""The suite's own scheduling (``tests/conftest.py``): under ``make test`` (pytest-xdist, ``--dist loadgroup``) the
users of a module-scoped fixture form one group, run on one worker, so that the fixture is built once."""

import pytest


@pytest.fixture(scope="module")
def module_fixture():
    return object()


def test_users_of_a_module_fixture_are_one_xdist_group(request, module_fixture):
    if not getattr(request.config.option, "loadgroup", False):  # set on pytest-xdist's workers under loadgroup
        pytest.skip("only under pytest-xdist's --dist loadgroup (make test)")
    # xdist schedules by this suffix; it is missing when conftest's hook runs after xdist's, or under pytest 9.2
    assert request.node.nodeid.endswith("@" + request.module.__name__), request.node.nodeid
