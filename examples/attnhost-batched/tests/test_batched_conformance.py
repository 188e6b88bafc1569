"""The conformance kit against this plugin: the whole suite, from one class attribute."""

from attnhost.testing import BackendConformance


class TestBatchedMatmul(BackendConformance):
    backend_name = "batched_matmul"
    expect_draft = True
