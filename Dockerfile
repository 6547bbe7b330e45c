# One image for the API, the worker and both fake rails; the command picks which.
FROM python:3.11-slim
WORKDIR /srv
COPY pyproject.toml requirements.lock README.md alembic.ini ./
RUN pip install --no-cache-dir -r requirements.lock
COPY app app
COPY fake_rails fake_rails
COPY migrations migrations
RUN pip install --no-cache-dir --no-deps -e . && useradd --system payments
USER payments
EXPOSE 8000
CMD ["payments", "api", "--host", "0.0.0.0", "--port", "8000"]
