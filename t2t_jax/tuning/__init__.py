"""Hyperparameter search: search files and Optuna storages, a run as a trial, summaries."""
