"""The page launch.serve shows at `/`: a question box, a database picker, the SQL and its result table;
with turns > 1 (/v1/sql's max_turns) also every query the episode ran and its transcript (observations included).

Invariants: one self-contained HTML document (no external scripts, fonts or styles: it works on a
machine with no internet); it talks only to its own origin's /v1/databases and /v1/sql; every value
from the server is inserted as text (textContent), never as HTML.
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>arctic-rl text-to-SQL</title>
<style>
 body { font: 15px system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
 textarea, input[type=text] { width: 100%; box-sizing: border-box; font: inherit; padding: .4em; }
 select, button { font: inherit; padding: .3em .8em; }
 pre { background: #f4f4f4; padding: .8em; white-space: pre-wrap; }
 table { border-collapse: collapse; margin-top: .5em; }
 td, th { border: 1px solid #bbb; padding: .2em .6em; }
 #error { color: #b00; } #timings { color: #666; font-size: 90%; }
 label { display: block; margin-top: .8em; }
</style>
</head>
<body>
<h1>Ask a database</h1>
<label>Database <select id="db"></select> <span id="tables"></span></label>
<label>Question <textarea id="question" rows="3" placeholder="Ask about the database picked above"></textarea></label>
<label>Evidence (optional) <input type="text" id="evidence"></label>
<label><input type="checkbox" id="execute" checked> run the SQL (read-only sandbox)</label>
<label>Turns <input type="number" id="turns" min="1" max="8" placeholder="as trained"> (above 1: the model may run queries and see their rows or error before it answers; empty: as the model trained)</label>
<p><button id="ask">Ask</button> <span id="status"></span></p>
<h2>SQL</h2>
<pre id="sql"></pre>
<div id="error"></div>
<div id="result"></div>
<div id="episode"></div>
<div id="timings"></div>
<script>
const $ = (id) => document.getElementById(id);
let schemas = {};
async function loadDatabases() {
  const r = await fetch('/v1/databases');
  const data = await r.json();
  for (const db of data.databases) {
    schemas[db.db_id] = db.tables.map((t) => t.name).join(', ');
    const o = document.createElement('option');
    o.value = db.db_id; o.textContent = db.db_id; $('db').appendChild(o);
  }
  showTables();
}
function showTables() { $('tables').textContent = schemas[$('db').value] ? 'tables: ' + schemas[$('db').value] : ''; }
function table(rows, columns) {
  const t = document.createElement('table');
  if (columns && columns.length) {
    const tr = document.createElement('tr');
    for (const c of columns) { const th = document.createElement('th'); th.textContent = c; tr.appendChild(th); }
    t.appendChild(tr);
  }
  for (const row of rows) {
    const tr = document.createElement('tr');
    for (const v of row) { const td = document.createElement('td'); td.textContent = v === null ? 'NULL' : String(v); tr.appendChild(td); }
    t.appendChild(tr);
  }
  return t;
}
async function ask() {
  $('status').textContent = 'thinking...'; $('sql').textContent = ''; $('error').textContent = '';
  $('result').textContent = ''; $('timings').textContent = ''; $('episode').textContent = '';
  const body = {question: $('question').value, db_id: $('db').value, evidence: $('evidence').value,
                execute: $('execute').checked, max_turns: Number($('turns').value) || 0};
  try {
    const r = await fetch('/v1/sql', {method: 'POST', headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body)});
    const data = await r.json();
    if (!r.ok) { $('error').textContent = data.error || ('HTTP ' + r.status); $('status').textContent = ''; return; }
    $('sql').textContent = data.sql || ('(no SQL in the answer) ' + data.completion);
    if (data.verdict && data.verdict !== 'ok') $('error').textContent = data.verdict + ': ' + data.error;
    if (data.rows && data.verdict === 'ok') {
      const p = document.createElement('p');
      p.textContent = data.row_count + ' row(s)' + (data.truncated ? ', first ' + data.rows.length + ' shown' : '');
      $('result').appendChild(p); $('result').appendChild(table(data.rows, data.columns));
    }
    if (data.turns !== undefined) showEpisode(data);
    $('timings').textContent = Object.entries(data.timings).map(([k, v]) => k + ' ' + v).join(', ')
      + ', batch of ' + data.batch_size;
    $('status').textContent = 'done';
  } catch (e) { $('error').textContent = String(e); $('status').textContent = ''; }
}
function showEpisode(data) {
  const h = document.createElement('h2');
  h.textContent = data.turns + ' turn(s), ' + data.queries.length + ' query(ies), ' + data.tool_errors + ' error(s)';
  const ol = document.createElement('ol');
  for (const q of data.queries) { const li = document.createElement('li'); li.textContent = q; ol.appendChild(li); }
  const pre = document.createElement('pre'); pre.textContent = data.completion;
  $('episode').appendChild(h); $('episode').appendChild(ol); $('episode').appendChild(pre);
}
$('db').addEventListener('change', showTables);
$('ask').addEventListener('click', ask);
loadDatabases();
</script>
</body>
</html>
"""
