"""specdraft: train speculative-decoding drafters and measure them in one lossless loop."""

__version__ = "0.1.0"
