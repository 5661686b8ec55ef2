// Take a lock, renew it, pass its fence to a resource and release it, over
// fencelock's HTTP/JSON API with net/http.
//
//	FENCELOCK_URL=http://127.0.0.1:7420 go run main.go [LOCK_NAME]
//
// Set FENCELOCK_TOKEN when the server has tokens configured.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"os"
	"time"
)

// Grant is the answer to an acquire: pass Fence to the resource with every write.
type Grant struct {
	Name       string `json:"name"`
	Fence      uint64 `json:"fence"`
	OwnerToken string `json:"owner_token"`
	TTLMs      uint64 `json:"ttl_ms"`
}

// Error is an error answer; Code is stable, branch on it.
type Error struct {
	Status  int
	Code    string `json:"code"`
	Message string `json:"message"`
}

func (e *Error) Error() string { return fmt.Sprintf("%d %s: %s", e.Status, e.Code, e.Message) }

// Client talks to one fencelock server.
type Client struct {
	URL   string
	Token string
	HTTP  *http.Client
}

func (c *Client) post(path string, body, answer any) error {
	payload, err := json.Marshal(body)
	if err != nil {
		return err
	}
	req, err := http.NewRequest(http.MethodPost, c.URL+path, bytes.NewReader(payload))
	if err != nil {
		return err
	}
	// Required of every body when authentication is off.
	req.Header.Set("Content-Type", "application/json")
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		var failure struct {
			Error Error `json:"error"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&failure); err != nil {
			return fmt.Errorf("status %d: %w", resp.StatusCode, err)
		}
		failure.Error.Status = resp.StatusCode
		return &failure.Error
	}
	return json.NewDecoder(resp.Body).Decode(answer)
}

// Acquire takes the lock, waiting up to waitMs if it is held.
func (c *Client) Acquire(name string, ttlMs, waitMs uint64, owner string) (Grant, error) {
	var g Grant
	err := c.post("/v1/acquire", map[string]any{"name": name, "ttl_ms": ttlMs, "wait_ms": waitMs, "owner": owner}, &g)
	return g, err
}

// Renew extends the grant's lease; the fence stays.
func (c *Client) Renew(g Grant, ttlMs uint64) (Grant, error) {
	var r Grant
	err := c.post("/v1/renew", map[string]any{"name": g.Name, "owner_token": g.OwnerToken, "ttl_ms": ttlMs}, &r)
	r.OwnerToken = g.OwnerToken
	return r, err
}

// Release gives the lock up.
func (c *Client) Release(g Grant) error {
	var r struct {
		Released bool `json:"released"`
	}
	return c.post("/v1/release", map[string]any{"name": g.Name, "owner_token": g.OwnerToken}, &r)
}

// Resource accepts a write only if its fence is newer than the last one it
// accepted (in a database: one conditional UPDATE).
type Resource struct {
	lastFence uint64
	value     string
}

func (r *Resource) Write(fence uint64, value string) error {
	if fence <= r.lastFence {
		return fmt.Errorf("stale fence %d (last %d)", fence, r.lastFence)
	}
	r.lastFence, r.value = fence, value
	return nil
}

func main() {
	url := os.Getenv("FENCELOCK_URL")
	if url == "" {
		url = "http://127.0.0.1:7420"
	}
	name := "example:go"
	if len(os.Args) > 1 {
		name = os.Args[1]
	}
	c := &Client{URL: url, Token: os.Getenv("FENCELOCK_TOKEN"), HTTP: &http.Client{Timeout: 30 * time.Second}}
	var resource Resource

	first, err := c.Acquire(name, 10_000, 0, "go-example")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("acquired %s with fence %d\n", name, first.Fence)
	if first, err = c.Renew(first, 20_000); err != nil {
		log.Fatal(err)
	}
	if err := resource.Write(first.Fence, "written by the first holder"); err != nil {
		log.Fatal(err)
	}
	if err := c.Release(first); err != nil {
		log.Fatal(err)
	}

	second, err := c.Acquire(name, 10_000, 0, "go-example-2")
	if err != nil {
		log.Fatal(err)
	}
	if err := resource.Write(second.Fence, "written by the second holder"); err != nil {
		log.Fatal(err)
	}
	if err := resource.Write(first.Fence, "a late write"); err != nil {
		fmt.Printf("the resource refused a write with fence %d: %v\n", first.Fence, err)
	}
	if err := c.Release(second); err != nil {
		log.Fatal(err)
	}
	fmt.Println("ok")
}
