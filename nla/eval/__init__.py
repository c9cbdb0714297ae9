"""Evaluation: the pair's held-out table (``evaluate``), the explanation suite (``suite``), the
linear probe (``probing``) and the quickstart's report (``report``)."""
