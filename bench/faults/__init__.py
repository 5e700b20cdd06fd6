"""Fault benches: SIGKILLs on a tiny run (chaos), an hour of faults (soak), a rank lost mid-collective; results in docs/reliability/."""
