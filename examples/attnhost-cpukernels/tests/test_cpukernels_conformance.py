"""The conformance kit against this plugin: the whole suite, from one class attribute."""

from attnhost.testing import BackendConformance


class TestCpuPaged(BackendConformance):
    backend_name = "cpu_paged"
    expect_draft = True
