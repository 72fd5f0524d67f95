"""Pipeline stages: schedules and their cost, the exact search over stages, reports and timelines."""
