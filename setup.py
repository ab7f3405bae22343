"""The build hook that puts the gRPC stubs into every wheel; everything else is in pyproject.toml.

The stubs (`arceus/v1/*_pb2*.py`) are generated from `protos/` and never committed: protoc writes the
protobuf version it ran into each one, so committed copies would differ from a regeneration whenever
grpcio-tools moves, and the protos would stop being the single source. grpcio-tools is therefore a build
requirement ([build-system] in pyproject.toml), and the hook runs `protos/generate.py` into the build
directory of a wheel, or into the source tree of an editable install (as `make install` does).
"""

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        super().run()
        out = ROOT if self.editable_mode else Path(self.build_lib)
        subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), str(out)], check=True)


setup(cmdclass={"build_py": BuildPyWithStubs})
