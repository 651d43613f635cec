import pytest

from services.cachemgr import daemon as daemon_module
from services.common.redis_server import EmbeddedRedis


@pytest.fixture(autouse=True)
def _strata_home(tmp_path, monkeypatch):
    """Profiles go to the test's directory, never to the user's $STRATA_HOME."""
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))


@pytest.fixture
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def fast_loop(monkeypatch):
    """Flush buffered counts every 0.1 s instead of every few seconds."""
    monkeypatch.setattr(daemon_module, "FLUSH_INTERVAL_S", 0.1)
