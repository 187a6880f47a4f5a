"""The HTML report's page (Jinja2, autoescaped): the heading figures, the machine and settings, the
charts. Styles inline; nothing is fetched when the page is opened."""

TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{{ title }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 960px; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 4px; } h2 { font-size: 1.1em; margin: 24px 0 4px; }
table { border-collapse: collapse; } th, td { padding: 3px 12px 3px 0; text-align: left; vertical-align: top; }
th { font-weight: 600; } td.num { font-variant-numeric: tabular-nums; }
.accounting, .note { color: #444; } details { margin: 8px 0; } code { font-size: 0.9em; }
</style>
{{ bokeh }}
</head>
<body>
<!-- report -->
<h1>{{ title }}</h1>
<table class="figures">
{% for f in figures %}<tr><th>{{ f.label }}</th><td class="num" data-figure="{{ f.key }}">{{ f.text }}</td></tr>
{% endfor %}</table>
{% if accounting %}<p class="accounting" data-figure="accounting">accounting:
{{ "{:,}".format(accounting.rows_read) }} read = {{ "{:,}".format(accounting.rows_written) }} written
+ {{ "{:,}".format(accounting.rows_rejected) }} rejected
+ {{ "{:,}".format(accounting.rows_resumed) }} resumed</p>{% endif %}
{% if machine %}<details open><summary>Machine and versions</summary><table>
<tr><th>CPU</th><td>{{ machine.cpu }} ({{ machine.cores }} cores)</td></tr>
<tr><th>CPU flags</th><td><code>{{ machine.cpu_flags | join(" ") }}</code></td></tr>
<tr><th>GPUs</th><td>{{ machine.gpus | join(", ") if machine.gpus else "none" }}</td></tr>
<tr><th>OS</th><td>{{ machine.os }}</td></tr>
<tr><th>versions</th><td>{% for k, v in machine.versions.items() %}{{ k }} {{ v }}
{%- if not loop.last %}, {% endif %}{% endfor %}</td></tr>
</table></details>{% endif %}
{% if settings %}<details><summary>Settings</summary><table>
{% for k, v in settings %}<tr><th>{{ k }}</th><td><code>{{ v }}</code></td></tr>
{% endfor %}</table></details>{% endif %}
{% for chart, div in charts %}<section class="chart" data-chart="{{ chart.key }}">
<h2>{{ chart.title }}</h2>
{{ div }}
{% if chart.note %}<p class="note">{{ chart.note }}</p>{% endif %}
</section>
{% endfor %}
{{ script }}
</body>
</html>
"""
