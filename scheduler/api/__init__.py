"""The REST API of `silod serve`: thin FastAPI routes over `scheduler.service.SchedulerService`."""
