"""The committed generated code is exactly what scripts/gen_protos.py produces."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_modules_import():
    from services.common.pb.strata.v1 import cachemgr_pb2_grpc, engine_pb2, engine_pb2_grpc

    assert engine_pb2.GenerateEvent(started=engine_pb2.Started(prompt_tokens=3)).started.prompt_tokens == 3
    assert hasattr(engine_pb2_grpc, "EngineStub") and hasattr(cachemgr_pb2_grpc, "CacheManagerStub")
