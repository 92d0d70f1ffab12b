"""The jobs the commands run: stats, adapt, bench, demo and inspect, as functions of
settings objects. They combine the layers below (method, data, models, artifact) and
name no command-line flag of their own."""
