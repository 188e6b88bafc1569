"""The conformance kit against this plugin: the whole suite, from one class attribute."""

from attnhost.testing import BackendConformance


class TestTiny(BackendConformance):
    backend_name = "tiny"
    expect_draft = True  # the shorthand registers target- and draft-capable backends
