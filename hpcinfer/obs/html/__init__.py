"""The HTML report: a run's (or a tune's) JSON report drawn as one self-contained page."""
