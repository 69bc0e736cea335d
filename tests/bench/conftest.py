"""The bench tests build tiny engines with the engine tests' fixtures and live daemons with the
daemon tests' one."""

from tests.daemon.conftest import live  # noqa: F401  (pytest fixture)
from tests.engine.conftest import _compile_cache, tiny, tok  # noqa: F401  (pytest fixtures)


def recording_resets(load, resets: list[bool]):
    """`load` (cfg -> engine) wrapped so its engine gets a pool that records, in `resets`, whether
    the engine had work at each reset: the fake engine has no pages of its own to forget."""

    def loaded(cfg):
        engine = load(cfg)

        class Pool:
            def reset(self) -> None:
                resets.append(engine.has_work())

        engine.pool = Pool()
        return engine

    return loaded
