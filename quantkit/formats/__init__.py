"""On-disk formats: one module per format, its pack order and dtypes defined there once."""
