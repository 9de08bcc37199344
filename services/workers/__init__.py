"""Celery workers that run evaluation episodes. ``celery_app`` is the app and its delivery settings."""
