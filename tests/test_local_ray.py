"""The Ray cluster a run starts for itself is a new one, whatever `RAY_ADDRESS` or an earlier `ray start` says."""

import types

import pytest


def test_the_run_s_own_cluster_is_started_with_address_local(monkeypatch):
    pytest.importorskip("ray", reason="the asynchronous mode needs Ray (the `async` extra)")
    from flowrl.run.local_ray import start_local_cluster

    calls = []
    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(address_info={}))
    # `ray.init()` without an address would join this one (and a dead head's address file is read the same way)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    start_local_cluster(fake, address=None, include_dashboard=False)
    assert calls == [{"address": "local", "include_dashboard": False}]
