"""Figures: histograms, targets and verdicts, the markdown and plot report."""
