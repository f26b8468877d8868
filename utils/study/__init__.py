"""The studies' engine, shared by utils/compare_norms.py, utils/depth_sweep.py and utils/width_sweep.py.

    engine      the flags every study takes, its runs (train, analyse, record), the records and the report helpers
    verdicts    paired verdicts on the paper's claims, with an effect and its 95% interval
"""
