"""The marker adapters decorate their hook implementations with: ``@plait.hookimpl``."""

import pluggy

hookimpl = pluggy.HookimplMarker("plait")
