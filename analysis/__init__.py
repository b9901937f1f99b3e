"""megasweep's analysis: torch-free calculators and reports over measured runs (e.g. `python -m analysis.calc`)."""
