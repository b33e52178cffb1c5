"""Optional libraries that gpunb imports (torchao, bitsandbytes, transformers) say nothing at import
about their own build, and the user's logging levels and warnings filters are as they were."""

import logging
import sys
import warnings

from gpunb.quiet import NOISY_LOGGERS, import_quietly

NOISY = '''
import logging, warnings
logging.getLogger("torchao").warning("Failed to load /site-packages/torchao/_C_mxfp8.so")
logging.getLogger("torch.utils._pytree").warning("<enum 'KernelPreference'> is an Enum subclass")
logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
warnings.warn("a notice of the library's own", UserWarning)
'''


def test_a_library_imported_by_gpunb_says_nothing_and_leaves_the_users_settings(tmp_path, monkeypatch, caplog):
    package = tmp_path / "torchao"  # a stand-in with torchao's name: its warnings are attributed to it
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "noisy.py").write_text(NOISY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchao", raising=False)
    logging.getLogger("torchao").setLevel(logging.INFO)  # the user's own choice, kept
    filters = list(warnings.filters)
    try:
        with caplog.at_level(logging.DEBUG), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import_quietly("torchao.noisy")
            logging.getLogger("torchao").warning("the user's own line after the import")
    finally:
        sys.modules.pop("torchao.noisy", None)
        sys.modules.pop("torchao", None)
    assert [r.getMessage() for r in caplog.records] == ["the user's own line after the import"]
    assert caught == []
    assert logging.getLogger("torchao").level == logging.INFO
    assert all(logging.getLogger(name).level != logging.ERROR for name in NOISY_LOGGERS)
    assert list(warnings.filters) == filters
