"""Offline tools over dumps: :mod:`.check` (rules judged again) and :mod:`.diff` (where two
runs parted)."""
