"""PeakTracker: live storage bytes after every operation, transient peaks included."""
import torch

from zerotrain.estimate.peak import PeakTracker


def test_a_freed_temporary_counts_in_the_peak_and_views_count_once():
    base = torch.zeros(100)                       # 400 bytes, there before tracking
    tracker = PeakTracker()
    with tracker:
        tracker.add_existing([base, base[:10]])   # a view of the same storage: once
        tracker.phase = "work"
        big = torch.ones(1000)                    # 4000 bytes
        tmp = big * 2                             # 4000 more, freed at once
        del tmp
        view = big[:500]                          # no new storage
        small = torch.ones(10)                    # 40 bytes
    assert tracker.peak == 400 + 4000 + 4000 and tracker.where == "work"
    assert tracker.current == 400 + 4000 + 40
    assert tracker.phase_peaks == {"before": 400, "work": 8400}
    assert sorted(n for n, _ in tracker.at_peak.values()) == [400, 4000, 4000]
    del view, small, big
