"""THE NAIVE TWIN: a deliberately unsafe payment service, for comparison only.

Never copy this. It exists so that `make bench` can measure what the
exactly-once machinery costs, and so that `make demo-naive-crash` can show the
double charge that machinery prevents.
"""
