"""
Packaging for svc, the tenant-aware LLM gateway: the svcd package, the
twistd plugins svc-auth, svc-proxy and svc-memory, and the svcctl operator command.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildWithMigrations(build_py):
    """
    Copy the migrations of the top-level sql/ folder into the built package
    as svcd/sql/, where an installed svcctl finds them. (A checkout or an
    editable install reads sql/ in place; see svcd/common/migrations.py.)

    A package_dir mapping for svcd.sql would do the same but would force
    setuptools' import-hook style of editable install (see package_dir).
    """

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "svcd" / "sql"
        target.mkdir(parents=True, exist_ok=True)
        for migration in sorted(Path("sql").glob("*.sql")):
            self.copy_file(str(migration), str(target / migration.name))


setup(
    name="svc-gateway",
    version="0.1.0",
    description="Tenant-aware LLM gateway: svc-proxy HTTP edge, svc-auth and svc-memory services",
    long_description=open("README.rst", encoding="utf-8").read(),
    long_description_content_type="text/x-rst",
    python_requires=">=3.11",
    # twisted.plugins is listed as a package without an __init__.py on
    # purpose: setuptools copies twisted/plugins/svc_plugins.py into the
    # installed twisted/plugins/ directory, where twistd discovers it.
    packages=[*find_packages(include=["svcd", "svcd.*"]), "twisted.plugins"],
    # Stated explicitly so that editable installs put the checkout itself on
    # sys.path (a .pth file), where twistd's plugin scan finds
    # twisted/plugins/; setuptools' import-hook editable mode would hide it.
    package_dir={"": "."},
    package_data={"svcd": ["py.typed", "pb/auth/v1/*.pyi", "pb/memory/v1/*.pyi"]},
    cmdclass={"build_py": BuildWithMigrations},
    install_requires=[
        # Bounded above: svc relies on a few private names of Twisted
        # (svcd/common/twistedprivate.py checks them at start); the bound
        # is the newest release they were checked with. The floor is
        # tested too: dev/floor (run by CI) runs the unit tests on it.
        "twisted>=25.5,<26.11",
        "klein>=24.8",
        "txredisapi>=1.4.10",
        # The generated modules under svcd/pb check these minimum versions.
        "grpcio>=1.85.1",
        "grpcio-health-checking>=1.85.1",
        "grpcio-reflection>=1.85.1",
        "protobuf>=7.35.1,<8",
        # 3.2.4: notifications that arrive while the connection runs a
        # query are kept for notifies() (psycopg #962); svc-auth's and
        # svc-memory's listeners query between their reads of them.
        "psycopg[binary]>=3.2.4",
        # 3.3: ConnectionPool.drain(), with which a daemon's pool leaves a
        # server that stopped taking writes (svcd/common/pgtransactions.py).
        "psycopg-pool>=3.3",
        "argon2-cffi>=23.1",
        "prometheus-client>=0.20",
        "opentelemetry-sdk>=1.25",
        "opentelemetry-exporter-otlp-proto-grpc>=1.25",
        "attrs>=23.1",
        # The parser of provider answers (svcd/providers/http1.py):
        # llhttp, Node's HTTP/1.1 parser, in C, strict by default; a
        # hand-written one was lenient where smuggling lives.
        "httptools>=0.6.2",
        # svc-memory's exact vector search (svcd/memory/vectors.py): each
        # cached scope is one contiguous float32 matrix, and a search is
        # one BLAS matrix-vector product that releases the GIL, so the
        # grpcio threads search in parallel; by hand in Python it would
        # cost a float object per component.
        "numpy>=1.26",
        # svc-memory runs numpy's BLAS one thread per search (svcd/memory/
        # tap.py): grpcio's threads already search in parallel, and
        # OpenBLAS's own threads, spinning beside them, made a search of
        # 1,000 memories take 12 ms instead of 0.09 ms on the loaded 2-core
        # machine. threadpoolctl (scikit-learn's) sets that at run time,
        # whatever BLAS numpy was built with and whenever numpy was
        # imported; an environment variable would have to precede numpy's
        # import.
        "threadpoolctl>=3.1",
    ],
    extras_require={
        "test": [
            # Below 9.2: pytest 9.2's structured node ids make
            # pytest-xdist 3.8's loadgroup scheduling a silent no-op (it
            # still writes the old field; pytest-dev/pytest-xdist#1386),
            # and tests/conftest.py schedules by it.
            "pytest>=8,<9.2",
            "pytest-twisted>=1.14",
            # dev/test runs the suite on several workers (-n auto; the
            # scheduling by shared fixture is in tests/conftest.py, and the
            # private names of pytest-xdist it relies on are checked at
            # start by tests/xdistprivate.py).
            "pytest-xdist>=3.6",
            "hypothesis>=6.100",
            # Pinned: the committed generated modules must equal what this
            # exact compiler produces (tests/test_proto.py checks it).
            "grpcio-tools==1.85.1",
            "mypy>=1.10",
            "mypy-zope>=1.0",
            "ruff>=0.5",
            "types-protobuf",
            # Security tests: throwaway CAs for mutual TLS, the OpenAPI
            # document's validator, and property-based API testing of the
            # live proxy against that document.
            "trustme>=1.1",
            "openapi-spec-validator>=0.7",
            "schemathesis>=4.0",
            # The official OpenAI SDK: users drive the gateway with it, so the
            # end-to-end tests use it as their client, and the scripted
            # upstream of svcd/devkit/upstream is checked against it.
            "openai>=1.40",
            # The official Anthropic SDK: svcd/dialects' translations are
            # checked against its types and its own stream accumulator
            # (messages.stream), and Anthropic's clients drive /v1/messages.
            # 2.17: the version they were checked with (its HTTP client is
            # httpx2, whose in-memory transport the tests use).
            "anthropic>=2.17",
            # A second, independent HTTP/1.1 parser: tests/test_proxy_http1.py
            # checks that the proxy's client accepts and refuses answers as it
            # does, and reads the same bodies.
            "h11>=0.14",
            # The in-process tests' HTTP client (svc-proxy's edge, its
            # operations site): only the tests use it; the proxy forwards
            # with its own client (svcd/proxy/forwarding/http1.py says why).
            "treq>=24.9",
        ],
    },
    entry_points={
        "console_scripts": ["svcctl = svcd.ctl.main:main"],
    },
    classifiers=[
        "Framework :: Twisted",
        "Programming Language :: Python :: 3",
    ],
)
