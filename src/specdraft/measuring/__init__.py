"""Measuring drafters on this machine: the one timing harness (measure.py), what to measure and its
report rows (evaluation.py), choosing decoding settings by measured tokens/s (tuning.py), the
reports (report_writer.py, benchmark_report.py), and decoding in llama.cpp's server
(llamacpp.py). The tools evaluate, tune and compare are its command lines.
"""
