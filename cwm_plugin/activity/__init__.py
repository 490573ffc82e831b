"""The deployment's append-only activity log (who did what, when, with how much context), so
one provider picks up where another left off: :class:`~cwm_plugin.activity.log.ActivityLog`."""
