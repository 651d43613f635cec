"""Where the cache manager keeps its live profiles: `expert-profile.bin` files.

    --profile PATH (default <data dir>/expert-profile.bin)
        PATH                           the first model's profile (the one found there at start,
                                       else the first model whose counts are saved)
        PATH's stem.<fingerprint>.bin  each further model, e.g. expert-profile.a1b2c3d4.bin

All are read at start and written (atomically) on an interval and at shutdown, in the format of
services.common.profile, so the engine can pre-fill from the same file.
"""

from __future__ import annotations

import logging
from pathlib import Path

from services.common.profile import Profile, ProfileError

log = logging.getLogger("strata.cachemgr")


class ProfileFiles:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._primary: str | None = None  # fingerprint key written at `path`
        self._failing = False

    def _sibling(self, fingerprint: str) -> Path:
        return self.path.with_name(f"{self.path.stem}.{fingerprint}{self.path.suffix}")

    def load(self) -> list[Profile]:
        """Every profile found. A corrupt file at PATH raises ProfileError (the operator named
        it, or it is ours and damaged); a corrupt sibling is logged and skipped."""
        profiles = []
        if self.path.exists():
            main = Profile.read(self.path)
            self._primary = main.fingerprint
            profiles.append(main)
        else:
            log.info("no expert profile at %s yet; it is written once routing counts arrive",
                     self.path)
        for sibling in sorted(self.path.parent.glob(f"{self.path.stem}.*{self.path.suffix}")):
            try:
                profiles.append(Profile.read(sibling))
            except ProfileError as exc:
                log.warning("skipping expert profile %s: %s", sibling, exc)
        for p in profiles:
            log.info("expert profile for model %s: %d layers x %d experts, %d pairs ranked "
                     "(built for %d slots)", p.fingerprint, p.num_layers, p.num_experts,
                     len(p.ranked), p.built_for_slots)
        return profiles

    def path_for(self, fingerprint: str) -> Path:
        if self._primary is None:
            self._primary = fingerprint
        return self.path if fingerprint == self._primary else self._sibling(fingerprint)

    def save(self, profiles: list[Profile]) -> list[Path]:
        """Write each profile; a failure is logged (once until a write succeeds), not raised."""
        written = []
        for profile in profiles:
            path = self.path_for(profile.fingerprint)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                profile.write(path)
            except (OSError, ProfileError) as exc:
                if not self._failing:
                    log.warning("cannot write the expert profile %s (%s); keeping it in memory "
                                "and retrying at the next save", path, exc)
                self._failing = True
                continue
            self._failing = False
            written.append(path)
        if written:
            log.debug("saved expert profiles: %s", ", ".join(map(str, written)))
        return written
